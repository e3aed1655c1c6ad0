"""The Debian packages a node needs (containerd, runc, CNI plugins, iptables, debootstrap for the base
image, busybox for small test images), installed when missing: CI and `./dev` start from fresh
machines, where nothing but the project's own files says what to install."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from rolloutfleet_testkit.controlplane.build import say

# Debian package → a file it installs (what tells whether it is there).
PACKAGES = {
    "containerd": "/usr/bin/containerd",
    "runc": "/usr/sbin/runc",
    "containernetworking-plugins": "/usr/lib/cni/bridge",
    "iptables": "/usr/sbin/iptables",
    "nftables": "/usr/sbin/nft",  # the guard that keeps pod traffic on this machine
    "iproute2": "/usr/sbin/ip",
    "conntrack": "/usr/sbin/conntrack",
    "debootstrap": "/usr/sbin/debootstrap",
    "busybox-static": "/bin/busybox",
    "tar": "/usr/bin/tar",
}


def missing_packages(exists=os.path.exists) -> list[str]:
    return sorted(name for name, path in PACKAGES.items() if not exists(path))


def ensure_debian_packages() -> None:
    missing = missing_packages()
    if not missing:
        return
    if shutil.which("apt-get") is None:
        raise RuntimeError(f"these Debian packages are needed and apt-get is not here: {' '.join(missing)}")
    say(f"installing Debian packages: {' '.join(missing)} (apt-get; ~20 s)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing],
    ):
        result = subprocess.run(command, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    still = missing_packages()
    if still:
        raise RuntimeError(f"installed, but still missing: {still} ({[PACKAGES[p] for p in still]})")


def which_paths() -> dict[str, Path]:
    return {name: Path(path) for name, path in PACKAGES.items()}
