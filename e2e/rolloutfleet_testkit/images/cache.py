"""Where built images are kept: outside the repository, under the project's cache."""

from __future__ import annotations

from pathlib import Path

from rolloutfleet_testkit.cache import project_cache


def images_cache() -> Path:
    root = project_cache() / "images"
    root.mkdir(parents=True, exist_ok=True)
    return root
