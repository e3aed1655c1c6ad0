"""Where the test kit keeps what it builds and downloads: outside the repository, per machine."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path


def project_cache() -> Path:
    """`$ROLLOUTFLEET_CACHE`, else ~/.cache/rolloutfleet (what ./dev uses for its environments too)."""
    return Path(os.environ.get("ROLLOUTFLEET_CACHE", Path.home() / ".cache" / "rolloutfleet"))


@contextlib.contextmanager
def exclusive(name: str) -> Iterator[None]:
    """Hold the cache's lock `name` (an flock, released when the process dies): two checkouts that
    prepare at once (a CI clone beside a work tree) would otherwise build into the same staging
    directories and rename each other's files away."""
    path = project_cache() / f"{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"[cache] waiting for another process holding {path}", flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
