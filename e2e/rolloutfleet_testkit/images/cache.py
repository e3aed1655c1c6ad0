"""Where built images are kept: outside the repository, under the project's cache."""

from __future__ import annotations

import os
from pathlib import Path


def images_cache() -> Path:
    root = Path(os.environ.get("ROLLOUTFLEET_CACHE", Path.home() / ".cache" / "rolloutfleet")) / "images"
    root.mkdir(parents=True, exist_ok=True)
    return root
