"""What Docker and kind's privileged nodes change on this machine, recorded before `up` and put back
by `down`: sysctls (systemd and the kubelet inside a privileged node write the host's), network
links (docker0, the kind network's bridge, veths), the nftables ruleset (Docker's chains, FORWARD
policy DROP, masquerading: iptables here is iptables-nft), the Debian packages Docker came in,
the docker group and Docker's files. Decisions are pure; `snapshot` and `restore` do the I/O."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path

from rolloutfleet_testkit.node.host import SYSCTLS as NODE_SYSCTLS
from rolloutfleet_testkit.node.host import mounts_under, read_sysctls, run, unmount_under, write_sysctls

# Seen to change (notes/kind.md) or set by kind's /etc/sysctl.d, beyond what a real node changes.
KIND_SYSCTLS = (
    "kernel.panic",
    "kernel.panic_on_oops",
    "vm.overcommit_memory",
    "fs.protected_fifos",
    "fs.protected_regular",
    "fs.protected_symlinks",
    "net.ipv4.conf.all.accept_redirects",
    "net.ipv4.conf.all.forwarding",
    "net.ipv6.conf.all.forwarding",
    "net.ipv4.conf.all.route_localnet",
    "net.ipv4.conf.all.arp_ignore",
    "net.ipv4.conf.all.rp_filter",
    "net.ipv4.conf.default.rp_filter",
)
SYSCTLS = tuple(dict.fromkeys((*NODE_SYSCTLS, *KIND_SYSCTLS)))
# Docker's state, configuration and run-time files (dockerd removes the last ones when it ends well).
DOCKER_PATHS = ("/var/lib/docker", "/etc/docker", "/run/docker", "/run/docker.sock", "/run/docker.pid")
DOCKER_GROUP = "docker"
DOCKER_MOUNT_ROOTS = ("/var/lib/docker", "/run/docker")  # containers' root filesystems, netns files


def _sysctl_values() -> dict[str, str]:
    values = read_sysctls()  # the node's list
    for name in SYSCTLS:
        path = Path("/proc/sys") / name.replace(".", "/")
        if name not in values and path.exists():
            values[name] = path.read_text().strip()
    return values


def installed_packages() -> list[str]:
    listing = run("dpkg-query", "-W", "-f", "${Package} ${db:Status-Status}\n", check=False).stdout
    return sorted(line.split()[0] for line in listing.splitlines() if line.endswith(" installed"))


def snapshot() -> dict[str, object]:
    """The host settings kind and Docker change, now."""
    links = run("ip", "-o", "link", "show", check=False).stdout.splitlines()
    groups = Path("/etc/group").read_text().splitlines()
    return {
        "sysctls": _sysctl_values(),
        "links": sorted(line.split(":")[1].strip().split("@")[0] for line in links),
        "nft ruleset": run("nft", "list", "ruleset", check=False).stdout,
        "packages": installed_packages(),
        "groups": sorted(line.split(":")[0] for line in groups if line),
        "docker mounts": [point for root in DOCKER_MOUNT_ROOTS for point in mounts_under(Path(root))],
        "docker paths": sorted(path for path in DOCKER_PATHS if os.path.lexists(path)),
    }


def differences(before: dict[str, object], after: dict[str, object]) -> dict[str, tuple[object, object]]:
    """Setting → (before, after) for every setting that differs; sysctls one by one. Pure."""
    changed: dict[str, tuple[object, object]] = {}
    for key in sorted(set(before) | set(after)):
        old, new = before.get(key), after.get(key)
        if key == "sysctls" and isinstance(old, dict) and isinstance(new, dict):
            for name in sorted(set(old) | set(new)):
                if old.get(name) != new.get(name):
                    changed[f"sysctl {name}"] = (old.get(name), new.get(name))
        elif old != new:
            changed[key] = (old, new)
    return changed


def added(before: dict[str, object], after: dict[str, object], key: str) -> list[str]:
    """What `after[key]` holds that `before[key]` did not (links, packages, groups, paths). Pure."""
    return sorted(set(after.get(key) or ()) - set(before.get(key) or ()))  # type: ignore[call-overload]


def restore(before: dict[str, object]) -> dict[str, tuple[object, object]]:
    """Put back what changed since `before` (Docker and its containers must be gone already); returns
    what still differs afterwards ({} when the host is as it was)."""
    now = snapshot()
    for link in added(before, now, "links"):
        run("ip", "link", "delete", link, check=False)
    if now["nft ruleset"] != before["nft ruleset"]:
        # The whole ruleset as it was: Docker's iptables-nft chains and tables go with the flush.
        run("nft", "flush", "ruleset", check=False)
        subprocess.run(["nft", "-f", "-"], input=str(before["nft ruleset"]), text=True, check=False)
    packages = added(before, now, "packages")
    if packages:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(
            ["apt-get", "purge", "-y", "-qq", *packages], env=env, capture_output=True, check=False
        )
    for root in DOCKER_MOUNT_ROOTS:  # dockerd unmounts what it mounted when it ends well
        unmount_under(Path(root))
    for path in added(before, now, "docker paths"):
        with contextlib.suppress(OSError):
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
    if DOCKER_GROUP in added(before, now, "groups"):
        run("groupdel", DOCKER_GROUP, check=False)
    write_sysctls(before["sysctls"])  # type: ignore[arg-type]
    return differences(before, snapshot())
