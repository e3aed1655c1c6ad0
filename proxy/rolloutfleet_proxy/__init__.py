"""The RolloutFleet inference data proxy: session-aware, token-exact, self-cleaning."""

import importlib.metadata

# One version source, pyproject.toml, through the installed package's metadata (images, the chart
# and the operator's default proxy image use the same); a bare source tree has none.
try:
    __version__ = importlib.metadata.version("rolloutfleet")
except importlib.metadata.PackageNotFoundError:
    __version__ = "0.0.0"
