"""The base image the project's Dockerfiles are built on here: Debian bookworm with its Python 3.11,
made by debootstrap from Debian's package mirror (no image registry is reachable from this
machine). It stands in for `python:3.11-slim`, the base users build on: `python`, `python3` and
`pip` on PATH, and pip allowed to install into the system Python (no EXTERNALLY-MANAGED marker, as
in the official image).
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import time
from pathlib import Path

from rolloutfleet_testkit.cache import exclusive

from .cache import images_cache
from .oci import tar_layer

SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
PACKAGES = ("python3", "python3-pip", "python3-venv", "ca-certificates", "tar", "procps")
# Base image names the Dockerfiles may name in FROM; all are this base here.
STANDS_IN_FOR = ("python:3.11-slim", "python:3.11")
ENV = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8")


def say(message: str) -> None:
    print(f"[images] {message}", flush=True)


def base_key() -> str:
    return hashlib.sha256(f"{SUITE} {MIRROR} {' '.join(PACKAGES)} v1".encode()).hexdigest()[:16]


def base_layer() -> Path:
    """The base's root filesystem as one layer (tar), built once per key and cached; the tree itself
    stays beside it (`rootfs/`), the lowest layer of the builds on top. Under the cache's lock: a
    second process building it at once would remove the tree under the first one's debootstrap."""
    with exclusive(f"base-{base_key()}"):
        return _base_layer()


def _base_layer() -> Path:
    directory = images_cache() / f"base-{base_key()}"
    layer = directory / "layer.tar"
    rootfs = directory / "rootfs"
    if layer.exists() and rootfs.is_dir():
        return layer
    if layer.exists():  # the tree was removed: unpack it again
        rootfs.mkdir()
        subprocess.run(["tar", "--numeric-owner", "-xf", str(layer), "-C", str(rootfs)], check=True)
        return layer
    started = time.monotonic()
    shutil.rmtree(rootfs, ignore_errors=True)
    rootfs.mkdir(parents=True)
    say(f"debootstrap {SUITE} (minbase + {', '.join(PACKAGES)}) into {rootfs}; ~1 min the first time")
    debootstrap(rootfs, PACKAGES)
    like_the_official_image(rootfs)
    # The tree's own mtimes: Debian compiled the stdlib's .pyc files against them (fixed times would
    # make every start of a non-root container compile the stdlib again).
    tar_layer(rootfs, layer, mtime=None)
    say(f"base image built in {time.monotonic() - started:.0f}s ({layer.stat().st_size / 2**20:.0f} MiB)")
    return layer


def debootstrap(rootfs: Path, packages: tuple[str, ...]) -> None:
    """A minbase Debian SUITE with `packages` into `rootfs`, the downloaded .debs kept in the cache."""
    cache_dir = images_cache() / "debootstrap-cache"
    cache_dir.mkdir(exist_ok=True)
    # Two debootstraps sharing a --cache-dir can trip over each other's files (a cold run's
    # base image beside kind's node rootfs did): one at a time.
    with exclusive("debootstrap-cache"):
        result = _run_debootstrap(rootfs, packages, cache_dir)
    if result.returncode != 0:
        raise RuntimeError(f"debootstrap failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")


def _run_debootstrap(rootfs: Path, packages: tuple[str, ...], cache_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            "debootstrap",
            "--variant=minbase",
            f"--include={','.join(packages)}",
            f"--cache-dir={cache_dir}",
            SUITE,
            str(rootfs),
            MIRROR,
        ],
        capture_output=True,
        text=True,
    )


def base_rootfs() -> Path:
    return base_layer().parent / "rootfs"


def like_the_official_image(rootfs: Path) -> None:
    """What Dockerfiles written for python:3.11-slim expect of their base."""
    for marker in (rootfs / "usr/lib").glob("python3*/EXTERNALLY-MANAGED"):
        marker.unlink()
    local_bin = rootfs / "usr/local/bin"
    local_bin.mkdir(parents=True, exist_ok=True)
    for name, target in (("python", "/usr/bin/python3"), ("pip", "/usr/bin/pip3")):
        link = local_bin / name
        if not link.exists():
            link.symlink_to(target)
    # Package lists and caches are not part of an image (the official one removes them too).
    for leftover in ("var/lib/apt/lists", "var/cache/apt/archives"):
        for path in (rootfs / leftover).glob("*"):
            if path.is_file():
                path.unlink()
