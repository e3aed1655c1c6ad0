"""The machine-wide settings a node needs, each recorded before it is changed and put back after:
sysctls, the pod bridge, a guard that keeps pod traffic inside this machine, cgroups, the iptables
chains kube-proxy and the kubelet make, mounts and network namespaces left by pods."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
from pathlib import Path

from .config import BRIDGE, BRIDGE_IP, POD_SUBNET

# Set by us (forwarding between pods and to Service addresses; bridged traffic through iptables so
# kube-proxy's rewrites apply between pods on the one bridge) or by the kubelet at start-up.
SYSCTLS = (
    "net.ipv4.ip_forward",
    "net.bridge.bridge-nf-call-iptables",
    "net.bridge.bridge-nf-call-ip6tables",
    "vm.overcommit_memory",
    "vm.panic_on_oom",
    "kernel.panic",
    "kernel.panic_on_oops",
    "kernel.keys.root_maxkeys",
    "kernel.keys.root_maxbytes",
)
OURS = {"net.ipv4.ip_forward": "1", "net.bridge.bridge-nf-call-iptables": "1"}
GUARD_TABLE = "rolloutfleet_guard"
GUARD_OUT, GUARD_IN = "pods-leaving-this-machine", "into-the-pod-subnet"
CGROUP_ROOT = Path("/sys/fs/cgroup")
NETNS_DIR = Path("/var/run/netns")


def run(*command: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(list(command), capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def _sysctl_path(name: str) -> Path:
    return Path("/proc/sys") / name.replace(".", "/")


def read_sysctls() -> dict[str, str]:
    return {name: _sysctl_path(name).read_text().strip() for name in SYSCTLS if _sysctl_path(name).exists()}


def write_sysctls(values: dict[str, str]) -> None:
    for name, value in values.items():
        path = _sysctl_path(name)
        if path.exists() and path.read_text().strip() != value:
            with contextlib.suppress(OSError):
                path.write_text(value)


def guard_ruleset() -> str:
    """An nftables table that drops anything pods send out of this machine (pods may reach each
    other, Service addresses and this host; forwarding elsewhere is refused), and anything forwarded
    into the pod subnet from outside. The counters let a test see the guard at work."""
    return f"""table inet {GUARD_TABLE} {{
  chain forward {{
    type filter hook forward priority -10; policy accept;
    iifname "{BRIDGE}" oifname != "{BRIDGE}" counter drop comment "{GUARD_OUT}"
    iifname != "{BRIDGE}" ip daddr {POD_SUBNET} counter drop comment "{GUARD_IN}"
  }}
}}
"""


def guard_counts(listing: dict) -> dict[str, int]:
    """Packets each guard rule dropped, from `nft -j list table` output (pure)."""
    counts = {}
    for item in listing.get("nftables", []):
        rule = item.get("rule")
        if not rule or "comment" not in rule:
            continue
        for expression in rule.get("expr", []):
            if "counter" in expression:
                counts[rule["comment"]] = int(expression["counter"]["packets"])
    return counts


def guard_dropped() -> dict[str, int]:
    """The guard's drop counters now: {GUARD_OUT: n, GUARD_IN: m} ({} if the guard is not up)."""
    import json

    result = run("nft", "-j", "list", "table", "inet", GUARD_TABLE, check=False)
    return guard_counts(json.loads(result.stdout)) if result.returncode == 0 else {}


def ensure_bridge_netfilter() -> None:
    """Bridged traffic must pass iptables, or a pod's reply to another pod on the bridge skips the
    un-DNAT of kube-proxy's Service rule and the client drops it: load br_netfilter if it is a module."""
    if not Path("/proc/sys/net/bridge").exists() and shutil.which("modprobe"):
        run("modprobe", "br_netfilter", check=False)
    if not Path("/proc/sys/net/bridge").exists():
        raise RuntimeError("the kernel lacks br_netfilter (net.bridge.*): Services between pods cannot work")


def bridge_up() -> None:
    ensure_bridge_netfilter()
    if run("ip", "link", "show", BRIDGE, check=False).returncode != 0:
        run("ip", "link", "add", BRIDGE, "type", "bridge")
    run("ip", "addr", "replace", f"{BRIDGE_IP}/16", "dev", BRIDGE)
    run("ip", "link", "set", BRIDGE, "up")


def bridge_down() -> None:
    run("ip", "link", "delete", BRIDGE, check=False)


def guard_up() -> None:
    run("nft", "delete", "table", "inet", GUARD_TABLE, check=False)
    subprocess.run(["nft", "-f", "-"], input=guard_ruleset(), text=True, check=True, capture_output=True)


def guard_down() -> None:
    run("nft", "delete", "table", "inet", GUARD_TABLE, check=False)


def cgroup_hierarchies(unified: bool = False) -> list[Path]:
    """The cgroup v1 hierarchies; with `unified`, also the v2 mount of a hybrid layout (runc makes a
    pod's cgroups there too, so they are removed from it as well)."""
    return sorted(
        path
        for path in CGROUP_ROOT.iterdir()
        if path.is_dir() and (unified or path.name != "unified") and (path / "cgroup.procs").exists()
    )


def make_cgroup_root(name: str) -> None:
    """The kubelet's cgroupRoot in every hierarchy; cpuset needs its cpus and mems filled in."""
    for hierarchy in cgroup_hierarchies():
        path = hierarchy / name.strip("/")
        path.mkdir(exist_ok=True)
        if hierarchy.name == "cpuset":
            for knob in ("cpuset.cpus", "cpuset.mems"):
                (path / knob).write_text((hierarchy / knob).read_text())


def remove_cgroup_root(name: str) -> None:
    """Depth first: a cgroup can only be removed once it has no children (and no processes)."""
    for hierarchy in cgroup_hierarchies(unified=True):
        top = hierarchy / name.strip("/")
        if not top.exists():
            continue
        for path in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                path.rmdir()
        with contextlib.suppress(OSError):
            top.rmdir()


def kube_chain_cleanup(listing: str) -> list[list[str]]:
    """The iptables arguments (after `-t TABLE`) that remove every KUBE-* chain of one table's
    `iptables -S` listing: first the jumps to them from other chains, then their rules, then the
    chains themselves (a chain can only be deleted once empty and unreferenced). Pure."""
    # iptables -S quotes comments ("kubernetes service portals"): split as a shell would, so a rule
    # is deleted with the very arguments it was made with.
    lines = [shlex.split(line) for line in listing.splitlines() if line.strip()]
    jumps = [
        ["-D", *parts[1:]]
        for parts in lines
        if parts[:1] == ["-A"]
        and not parts[1].startswith("KUBE-")
        and any(p.startswith("KUBE-") for p in parts[2:])
    ]
    chains = [parts[1] for parts in lines if parts[:1] == ["-N"] and parts[1].startswith("KUBE-")]
    return [*jumps, *(["-F", chain] for chain in chains), *(["-X", chain] for chain in chains)]


def remove_kube_chains() -> None:
    """Every KUBE-* chain (kube-proxy's and the kubelet's canaries) and the rules that jump to them,
    in IPv4 and IPv6 iptables; nothing else is touched."""
    for tool in ("iptables", "ip6tables"):
        for table in ("filter", "nat", "mangle", "raw"):
            listing = run(tool, "-t", table, "-S", check=False)
            if listing.returncode != 0:
                continue
            for command in kube_chain_cleanup(listing.stdout):
                run(tool, "-t", table, *command, check=False)


def mount_points_under(mountinfo: str, root: Path) -> list[str]:
    """Mount points below `root` in a /proc/self/mountinfo text, deepest first (the order they can be
    unmounted in). Pure."""
    prefix = str(root).rstrip("/") + "/"
    points = set()
    for line in mountinfo.splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point.startswith(prefix):
            points.add(point)
    return sorted(points, key=lambda p: (-p.count("/"), p))


def mounts_under(root: Path) -> list[str]:
    return mount_points_under(Path("/proc/self/mountinfo").read_text(), root.resolve())


def unmount_under(root: Path) -> None:
    for _ in range(3):  # stacked mounts come off one layer per pass
        points = mounts_under(root)
        if not points:
            return
        for point in points:
            run("umount", "-l", point, check=False)


def netns_names() -> set[str]:
    return {path.name for path in NETNS_DIR.iterdir()} if NETNS_DIR.exists() else set()


def remove_netns(names: set[str]) -> None:
    for name in names:
        path = NETNS_DIR / name
        run("umount", "-l", str(path), check=False)
        with contextlib.suppress(OSError):
            path.unlink()


def remove_log_links(root: Path) -> None:
    """The kubelet links each container's log from /var/log/containers; remove links into `root`."""
    links = Path("/var/log/containers")
    if not links.is_dir():
        return
    for link in links.iterdir():
        with contextlib.suppress(OSError):
            if link.is_symlink() and str(link.readlink()).startswith(str(root)):
                link.unlink()


def nft_tables() -> set[str]:
    listing = run("nft", "list", "tables", check=False)
    return {line.strip() for line in listing.stdout.splitlines() if line.startswith("table ")}


def remove_new_tables(before: set[str]) -> None:
    """Tables that appeared while the node ran (iptables-nft makes `ip filter`, `ip nat`, … on first
    use): removed once their KUBE-* chains are gone."""
    for table in nft_tables() - before:
        run("nft", "delete", *table.removeprefix("table ").split(), check=False)


def host_state() -> dict[str, object]:
    """What a node changes on this machine, for checking that teardown put it all back."""
    links = run("ip", "-o", "link", "show", check=False).stdout.splitlines()
    chains = [
        line
        for tool in ("iptables-save", "ip6tables-save")
        for line in run(tool, check=False).stdout.splitlines()
        if "KUBE-" in line
    ]
    cgroups = [
        str(path)
        for hierarchy in cgroup_hierarchies(unified=True)
        for path in hierarchy.glob("rolloutfleet-*")
    ]
    return {
        "sysctls": read_sysctls(),
        "cgroups": sorted(cgroups),
        "links": sorted(line.split(":")[1].strip().split("@")[0] for line in links),
        "nft tables": sorted(nft_tables()),
        "KUBE-* iptables lines": len(chains),
        "network namespaces": sorted(netns_names()),
    }


def node_processes(exclude: set[int] = frozenset()) -> dict[int, str]:
    """Kubelets, kube-proxies (and API servers on the bridge) in this machine's network namespace
    (other than `exclude`): nodes of another cluster, whose bridge, iptables chains and cgroups must
    be neither taken over nor removed. (Those of kind nodes live in network namespaces of their own
    and do not count.)"""
    own_net = os.readlink("/proc/self/ns/net")
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) in exclude:
            continue
        with contextlib.suppress(OSError):
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
            name = Path(argv[0]).name
            # An API server on the bridge address: a cluster between creating its bridge and its nodes.
            ours = name in ("kubelet", "kube-proxy") or (
                name == "kube-apiserver" and BRIDGE_IP in " ".join(argv)
            )
            if ours and os.readlink(proc / "ns/net") == own_net:
                found[int(proc.name)] = " ".join(argv)[:200]
    return found


def kill_cgroup_processes(name: str) -> int:
    """SIGKILL every process left in the cgroup tree `name` (a kubelet's cgroupRoot: only pods of
    ours run there, e.g. containers whose shim died first); returns how many there were."""
    pids: set[int] = set()
    for hierarchy in cgroup_hierarchies(unified=True):
        top = hierarchy / name.strip("/")
        if top.exists():
            for procs in top.rglob("cgroup.procs"):
                with contextlib.suppress(OSError, ValueError):
                    pids.update(int(line) for line in procs.read_text().split())
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return len(pids)
