"""Where the test kit keeps what it builds and downloads: outside the repository, per machine."""

from __future__ import annotations

import os
from pathlib import Path


def project_cache() -> Path:
    """`$ROLLOUTFLEET_CACHE`, else ~/.cache/rolloutfleet (what ./dev uses for its environments too)."""
    return Path(os.environ.get("ROLLOUTFLEET_CACHE", Path.home() / ".cache" / "rolloutfleet"))
