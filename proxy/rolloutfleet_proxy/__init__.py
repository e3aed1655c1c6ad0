"""The RolloutFleet inference data proxy: session-aware, token-exact, self-cleaning."""

__version__ = "0.1.0"
