"""A real local Kubernetes: the control plane, and two real nodes on this machine.

`real_cluster(root)` brings up, in order: the pod bridge and the guard that keeps pod traffic on
this machine; the control plane listening on the bridge address (so pods reach it as the
`kubernetes` Service); per node a containerd (Debian's, with runc and the CNI bridge plugin) and a
kubelet; one kube-proxy (iptables) for the host; CoreDNS behind the `kube-dns` Service. The GPU node
carries the label, taint and `nvidia.com/gpu` capacity GPU pods are scheduled by (no GPU exists
here: the capacity is advertised through the node's status, as the Kubernetes docs describe for
extended resources). Everything it changed is put back at the end, and only what it started is
stopped.

Two nodes need two kubelets, and a kubelet kills the pods in its runtime that are not bound to it,
so each node has its own containerd; both share the bridge, each handing out its own address slice.

`up(root)` and `down(root)` are the two halves of `real_cluster` for a cluster that outlives the
process starting it (`python -m rolloutfleet_testkit.node up|down|status`): what `down` needs (the
PIDs started, the sysctls, network namespaces and nftables tables found before) is kept in
`root/node-state.json`, written as each part starts so a failed or interrupted `up` is undone too.
One cluster runs per machine: the bridge, the iptables chains and the guard are machine-wide. So the
state is also copied to `/run/rolloutfleet-node/` (cleared by a reboot, as what it describes is): a
run killed outright (its processes gone, its machine-wide settings still in place) is then undone by
the next `up`, whichever directory that run used and whether or not that directory still exists.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rolloutfleet_testkit.cache import exclusive, project_cache
from rolloutfleet_testkit.controlplane import cluster as controlplane
from rolloutfleet_testkit.controlplane.build import ensure_binaries
from rolloutfleet_testkit.controlplane.pki import Pki, kubeconfig
from rolloutfleet_testkit.images.oci import ImportFailed, import_archive
from rolloutfleet_testkit.images.static import static_image
from rolloutfleet_testkit.kubectl import Kubectl
from rolloutfleet_testkit.processes import free_port, free_ports
from rolloutfleet_testkit.waiting import log_tail, wait_for

from . import host
from .binaries import PAUSE_VERSION, coredns_binary, ensure_node_binaries
from .config import (
    BRIDGE_IP,
    COREDNS_IMAGE,
    GPU_COUNT,
    GPU_RESOURCE,
    NODES,
    PAUSE_IMAGE,
    NodeDirs,
    NodeSpec,
    as_list,
    cgroup_root,
    cni_conflist,
    containerd_config,
    dns_objects,
    kube_proxy_config,
    kubelet_args,
    kubelet_config,
    node_access_objects,
)
from .packages import ensure_debian_packages

DNS_HEALTH_PORT, DNS_READY_PORT = 18080, 18181


STATE_FILE = "node-state.json"
# The machine-wide copy of the running cluster's state (see the module's docstring).
MACHINE_RECORD = Path("/run/rolloutfleet-node") / STATE_FILE


def default_dir() -> Path:
    cache = project_cache()
    return cache / "node-cluster"


def say(message: str) -> None:
    print(f"[node] {message}", flush=True)


@dataclass
class RealCluster:
    root: Path
    kubeconfig: str
    bin_dir: Path
    containerd_by_node: dict[str, str]  # node name → its containerd's socket
    bridge_ip: str = BRIDGE_IP
    pids: dict[str, int] = field(default_factory=dict)
    # The machine before `up` (what `down` puts back or removes).
    sysctls: dict[str, str] = field(default_factory=dict)
    netns_before: list[str] = field(default_factory=list)
    tables_before: list[str] = field(default_factory=list)
    # host.host_state() once earlier runs' leftovers were cleared: what teardown must leave behind.
    host_before: dict = field(default_factory=dict)

    @property
    def containerd_addresses(self) -> list[str]:
        return list(self.containerd_by_node.values())

    @property
    def gpu_containerd_addresses(self) -> list[str]:
        return [self.containerd_by_node[n.name] for n in NODES if n.gpu and n.name in self.containerd_by_node]

    def kubectl(self) -> Kubectl:
        return Kubectl(str(self.bin_dir / "kubectl"), self.kubeconfig, timeout_s=120)

    def import_image(self, archive: Path) -> None:
        """Into every node's containerd (each node has its own image store)."""
        for address in self.containerd_addresses:
            import_archive(archive, address)

    def save(self) -> None:
        data = {**asdict(self), "root": str(self.root), "bin_dir": str(self.bin_dir)}
        text = json.dumps(data, indent=2) + "\n"
        for path in (self.root / STATE_FILE, MACHINE_RECORD):
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(f"{STATE_FILE}.partial")
            partial.write_text(text)
            partial.replace(path)

    def forget(self) -> None:
        """After teardown: neither this directory nor the machine holds a cluster any more."""
        (self.root / STATE_FILE).unlink(missing_ok=True)
        if MACHINE_RECORD.exists() and RealCluster.read(MACHINE_RECORD).root == self.root:
            MACHINE_RECORD.unlink()

    @classmethod
    def load(cls, root: Path) -> RealCluster | None:
        path = root / STATE_FILE
        return cls.read(path) if path.exists() else None

    @classmethod
    def read(cls, path: Path) -> RealCluster:
        data = json.loads(path.read_text())
        return cls(**{**data, "root": Path(data["root"]), "bin_dir": Path(data["bin_dir"])})


def recorded_clusters(root: Path) -> list[RealCluster]:
    """The clusters `up` in `root` must deal with first: the one recorded in `root`, and the one the
    machine records if it ran from another directory (a run killed before its teardown)."""
    found = [RealCluster.load(root)]
    if MACHINE_RECORD.exists():
        machine = RealCluster.read(MACHINE_RECORD)
        if machine.root != root:
            found.append(machine)
    return [cluster for cluster in found if cluster is not None]


def _start(name: str, args: list[str], logs: Path, env: dict[str, str] | None = None) -> int:
    log = open(logs / f"{name}.log", "ab")  # noqa: SIM115 (handed to the child)
    process = subprocess.Popen(
        args,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    log.close()
    return process.pid


def _alive(pid: int) -> bool:
    # 0 or less would name a process group (ours) to waitpid and kill: never a recorded process.
    return pid > 0 and controlplane._alive(pid)


def recorded_program(name: str) -> str:
    """The program a recorded process runs: "controlplane:etcd" → etcd, "kubelet:rf-cpu-node" →
    kubelet. Pure."""
    first, _, rest = name.partition(":")
    return rest if first == "controlplane" else first


def _still_runs(name: str, pid: int) -> bool:
    """A recorded process still runs only if its PID runs the recorded program (PIDs are reused)."""
    with contextlib.suppress(OSError):
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        return _alive(pid) and Path(argv0).name == recorded_program(name)
    return False


def _stop(pid: int, timeout_s: float = 20) -> None:
    if not _alive(pid):
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def _wait(what: str, check, timeout_s: float, log: Path | None = None, interval_s: float = 0.2):
    """`wait_for`, with the tail of `log` in the error."""
    return wait_for(check, timeout_s, what, interval_s, detail=lambda: log_tail(log))


def image_store(node: NodeSpec) -> Path:
    cache = project_cache()
    return cache / "node" / node.name / "containerd-root"


def _containerd_up(dirs: NodeDirs) -> bool:
    result = subprocess.run(
        ["ctr", "--address", str(dirs.socket), "version"], capture_output=True, text=True, timeout=10
    )
    return result.returncode == 0


def _node_images(bin_dir: Path) -> list[Path]:
    return [
        static_image(bin_dir / f"pause-{PAUSE_VERSION}", PAUSE_IMAGE, ["/bin/pause"]),
        static_image(coredns_binary(), COREDNS_IMAGE, ["/bin/coredns"]),
    ]


def _ready_nodes(kubectl: Kubectl) -> set[str]:
    nodes = kubectl.json("nodes").get("items", [])
    return {
        n["metadata"]["name"]
        for n in nodes
        if any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"].get("conditions", []))
    }


def _advertise_gpus(kubectl: Kubectl, node: NodeSpec) -> None:
    """`nvidia.com/gpu` capacity through the node's status, as a device plugin's would appear.

    How the kubelet (v1.35, pkg/kubelet/nodestatus.MachineInfo) treats it: each status update sets
    only the capacity entries it owns (cpu, memory, pods, ephemeral storage, hugepages, device-plugin
    resources) and leaves others alone; allocatable is then derived from every capacity entry, so
    patching capacity is enough. It zeroes extended resources only when it re-registers with an
    existing Node object and its device manager has no checkpoint (a kubelet restart): not here,
    where every cluster registers fresh nodes. Patched until the value is seen in allocatable, in
    case an update of the kubelet's raced the patch."""
    patch = {"status": {"capacity": {GPU_RESOURCE: str(GPU_COUNT)}}}
    kubectl("patch", "node", node.name, "--subresource=status", "--type=merge", "-p", json.dumps(patch))


def _gpus(kubectl: Kubectl, node: NodeSpec) -> str | None:
    return kubectl.json("node", node.name)["status"].get("allocatable", {}).get(GPU_RESOURCE)


def _refuse_or_clear_leftovers(root: Path) -> None:
    """One cluster per machine. A cluster recorded in `root` whose processes are gone is cleaned up;
    a node of another cluster still running is refused (its bridge and chains are in use); a bridge
    or guard left by a run that was killed outright is removed."""
    for existing in recorded_clusters(root):
        alive = {name: pid for name, pid in existing.pids.items() if _still_runs(name, pid)}
        if alive:
            raise RuntimeError(f"a cluster is running from {existing.root} ({alive}); run `down` first")
        say(f"cleaning up after an earlier cluster in {existing.root}")
        existing.pids = {}  # all gone: a PID reused since then must not be signalled
        _teardown(existing)
        existing.forget()
    others = host.node_processes()
    if others:
        listing = "\n".join(f"  {pid}: {cmd}" for pid, cmd in others.items())
        raise RuntimeError(f"another local cluster's nodes are running on this machine:\n{listing}")
    if host.run("ip", "link", "show", host.BRIDGE, check=False).returncode == 0:
        say(f"removing the bridge {host.BRIDGE} and the guard left by an earlier run")
        host.guard_down()
        host.bridge_down()
    # Only what a cluster makes here is cleared: `root` may be a directory the caller also uses.
    host.unmount_under(root)
    if host.mounts_under(root):
        raise RuntimeError(f"cannot clear {root}: still mounted below it: {host.mounts_under(root)}")
    for name in ("logs", *(n.name for n in NODES)):
        shutil.rmtree(root / name, ignore_errors=True)


# What a run of the suite writes beside the images (pod logs, journals, dumps, containerd snapshots)
# is about 1-2 GiB; the kubelets never reclaim disk (see config.kubelet_config), so a disk that
# fills mid-run fails pods instead: refused up front.
MIN_FREE_DISK_BYTES = 3 * 2**30


def _refuse_full_disk(*paths: Path) -> None:
    for path in paths:
        free = shutil.disk_usage(path).free
        if free < MIN_FREE_DISK_BYTES:
            raise RuntimeError(
                f"only {free / 2**30:.1f} GiB free on the disk holding {path}; a cluster needs "
                f"{MIN_FREE_DISK_BYTES / 2**30:.0f} GiB (its kubelets never reclaim disk): free some space, "
                f"e.g. build steps of old images under {project_cache() / 'images' / 'layers'}"
            )


def up(root: Path | None = None, timeout_s: float = 180) -> RealCluster:
    """Start the cluster in `root` (default: the cache's node-cluster/) and return it once both
    nodes are Ready, CoreDNS answers and the `default` ServiceAccount exists. On any failure (or
    interruption) everything started so far is stopped and put back before the error propagates."""
    root = (root or default_dir()).resolve()
    started = time.monotonic()

    def progress(message: str) -> None:
        say(f"{message} ({time.monotonic() - started:.1f}s)")

    # ./dev test builds the parts in the background while the unit tests run: wait for it, then
    # everything below is found in the cache (or, had it failed, built here with its error shown).
    with exclusive("prepare"):
        pass
    ensure_debian_packages()
    bins = ensure_binaries()
    node_bins = ensure_node_binaries()
    archives = _node_images(node_bins)
    _refuse_or_clear_leftovers(root)
    root.mkdir(parents=True, exist_ok=True)
    _refuse_full_disk(root, project_cache())
    (root / "logs").mkdir(parents=True)  # the control plane clears and makes its own directory
    cluster = RealCluster(
        root,
        kubeconfig="",
        bin_dir=bins,
        containerd_by_node={},
        sysctls=host.read_sysctls(),
        netns_before=sorted(host.netns_names()),
        tables_before=sorted(host.nft_tables()),
        host_before=host.host_state(),
    )
    cluster.save()
    try:
        _bring_up(cluster, archives, timeout_s, progress)
    except BaseException:
        say("start-up failed: stopping what was started")
        _teardown(cluster)
        cluster.forget()
        raise
    progress(f"cluster up; export KUBECONFIG={cluster.kubeconfig}")
    return cluster


def _bring_up(cluster: RealCluster, archives: list[Path], timeout_s: float, progress) -> None:
    root, bins, pids, logs = cluster.root, cluster.bin_dir, cluster.pids, cluster.root / "logs"
    host.bridge_up()
    host.guard_up()
    host.write_sysctls(host.OURS)
    progress(f"bridge {BRIDGE_IP}/16 up; pod traffic kept on this machine")
    node_names = tuple(n.name for n in NODES)
    try:
        state = controlplane.up(root / "controlplane", address=BRIDGE_IP, nodes=node_names)
    finally:
        recorded = controlplane.ClusterState.load(root / "controlplane")
        pids.update({f"controlplane:{k}": v for k, v in (recorded.pids if recorded else {}).items()})
        cluster.save()
    pki = Pki(Path(state.directory) / "pki")
    cluster.kubeconfig = state.kubeconfig
    cluster.save()
    kubectl = cluster.kubectl()
    kubectl("apply", "-f", "-", input=as_list(node_access_objects()))
    for node in NODES:
        dirs = NodeDirs(root / node.name, image_store(node))
        for path in (
            dirs.containerd,
            dirs.cni_conf,
            dirs.ipam,
            dirs.kubelet,
            dirs.pod_logs,
            dirs.root / "manifests",
        ):
            path.mkdir(parents=True, exist_ok=True)
        (dirs.cni_conf / "10-rolloutfleet.conflist").write_text(
            json.dumps(cni_conflist(node, dirs), indent=2)
        )
        (dirs.containerd / "config.toml").write_text(containerd_config(dirs))
        (dirs.root / "resolv.conf").write_text("# pods get the cluster's DNS from the kubelet\n")
        pids[f"containerd:{node.name}"] = _start(
            f"containerd-{node.name}", ["containerd", "--config", str(dirs.containerd / "config.toml")], logs
        )
        cluster.save()
        _wait(
            f"containerd of {node.name}",
            lambda dirs=dirs: _containerd_up(dirs),
            30,
            logs / f"containerd-{node.name}.log",
        )
        cluster.containerd_by_node[node.name] = str(dirs.socket)
        cluster.save()
        for archive in archives:
            import_archive(archive, str(dirs.socket))
        host.make_cgroup_root(cgroup_root(node))
        config = kubelet_config(
            node,
            dirs,
            free_port(BRIDGE_IP),
            free_port(),
            pki.ca_cert,
            pki.client(f"node-{node.name}-serving"),
        )
        (dirs.root / "kubelet-config.json").write_text(json.dumps(config, indent=2))
        node_kubeconfig = dirs.root / "kubelet.kubeconfig"
        node_kubeconfig.write_text(kubeconfig(state.apiserver_url, pki, f"node-{node.name}"))
        pids[f"kubelet:{node.name}"] = _start(
            f"kubelet-{node.name}", kubelet_args(node, dirs, bins / "kubelet", node_kubeconfig), logs
        )
        cluster.save()
    progress(f"containerd and kubelet started for {', '.join(node_names)}")
    proxy_kubeconfig = root / "kube-proxy.kubeconfig"
    proxy_kubeconfig.write_text(kubeconfig(state.apiserver_url, pki, "kube-proxy"))
    proxy_config = kube_proxy_config(proxy_kubeconfig, NODES[0].name, *free_ports(2))
    (root / "kube-proxy-config.json").write_text(json.dumps(proxy_config, indent=2))
    pids["kube-proxy"] = _start(
        "kube-proxy", [str(bins / "kube-proxy"), f"--config={root / 'kube-proxy-config.json'}"], logs
    )
    cluster.save()
    _wait(
        "both nodes Ready",
        lambda: _ready_nodes(kubectl) >= set(node_names),
        timeout_s,
        logs / f"kubelet-{NODES[-1].name}.log",
        interval_s=0.5,
    )
    progress("both nodes Ready")
    for node in NODES:
        if node.gpu:
            _wait(
                f"{GPU_RESOURCE} on {node.name}",
                lambda node=node: _advertise_gpus(kubectl, node) or _gpus(kubectl, node) == str(GPU_COUNT),
                30,
                interval_s=1,
            )
    kubectl("apply", "-f", "-", input=as_list(dns_objects(DNS_HEALTH_PORT, DNS_READY_PORT)))
    kubectl("rollout", "status", "deployment/coredns", "-n", "kube-system", f"--timeout={int(timeout_s)}s")
    _wait(
        "the default ServiceAccount",
        lambda: kubectl.run("get", "serviceaccount", "default").returncode == 0,
        60,
    )
    progress("CoreDNS ready")


def _node(name: str) -> NodeSpec:
    return next(node for node in NODES if node.name == name)


def stop_kubelet(root: Path, node_name: str) -> None:
    """Kill a node's kubelet outright (SIGKILL), as a machine that died takes its kubelet with it:
    its containers go on under containerd, nothing reports them; the node lifecycle controller
    marks the node NotReady once its heartbeats stop. `start_kubelet` brings it back."""
    cluster = RealCluster.load(root)
    if cluster is None:
        raise RuntimeError(f"no cluster recorded in {root}")
    pid = cluster.pids.get(f"kubelet:{node_name}", 0)
    if _still_runs(f"kubelet:{node_name}", pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        _wait(f"the kubelet of {node_name} to exit", lambda: not _alive(pid), 10)


def start_kubelet(root: Path, node_name: str, timeout_s: float = 120) -> None:
    """Start a node's kubelet again with its configuration, recorded so `down` stops it, and wait
    until the node is Ready (with its GPU capacity again, which a restarted kubelet may drop)."""
    cluster = RealCluster.load(root)
    if cluster is None:
        raise RuntimeError(f"no cluster recorded in {root}")
    node = _node(node_name)
    dirs = NodeDirs(root / node.name, image_store(node))
    logs = root / "logs"
    args = kubelet_args(node, dirs, cluster.bin_dir / "kubelet", dirs.root / "kubelet.kubeconfig")
    cluster.pids[f"kubelet:{node.name}"] = _start(f"kubelet-{node.name}", args, logs)
    cluster.save()
    kubectl = cluster.kubectl()
    _wait(
        f"{node.name} Ready again",
        lambda: node.name in _ready_nodes(kubectl),
        timeout_s,
        logs / f"kubelet-{node.name}.log",
        interval_s=0.5,
    )
    if node.gpu:
        _wait(
            f"{GPU_RESOURCE} on {node.name}",
            lambda: _advertise_gpus(kubectl, node) or _gpus(kubectl, node) == str(GPU_COUNT),
            30,
            interval_s=1,
        )


def down(root: Path | None = None) -> None:
    """Stop the cluster recorded in `root` and put the machine back as `up` found it."""
    root = (root or default_dir()).resolve()
    cluster = RealCluster.load(root)
    if cluster is None:
        say(f"no cluster recorded in {root}")
        return
    started = time.monotonic()
    _teardown(cluster)
    cluster.forget()
    say(f"torn down in {time.monotonic() - started:.1f}s")


def status(root: Path | None = None) -> dict[str, str]:
    """Each recorded process: running or stopped (with its PID); {} if no cluster is recorded."""
    cluster = RealCluster.load((root or default_dir()).resolve())
    if cluster is None:
        return {}
    return {
        name: ("running" if _alive(pid) else "stopped") + f" (pid {pid})"
        for name, pid in cluster.pids.items()
    }


@contextlib.contextmanager
def real_cluster(
    root: Path, timeout_s: float = 180, images: Sequence[str] = (), gpu_images: Sequence[str] = ()
) -> Iterator[RealCluster]:
    """The cluster, up for the body of the `with` and torn down after it (also on failure), with
    `images` in every node's containerd and `gpu_images` in the GPU node's."""
    cluster = up_with_images(root, timeout_s, images, gpu_images)
    try:
        yield cluster
    finally:
        down(cluster.root)


def up_with_images(
    root: Path, timeout_s: float, images: Sequence[str], gpu_images: Sequence[str]
) -> RealCluster:
    """`up`, then the images imported. A node's image store that refuses an import (damaged by a
    run killed mid-write) is emptied and the cluster started again, once: the stores are caches."""
    from rolloutfleet_testkit.images import ensure_images

    for attempt in (1, 2):
        cluster = None
        try:
            cluster = up(root, timeout_s)
            ensure_images(images, cluster.containerd_addresses)
            ensure_images(gpu_images, cluster.gpu_containerd_addresses)
            return cluster
        except ImportFailed as error:
            if cluster is not None:
                down(cluster.root)
            if attempt == 2:
                raise
            say(f"an image store refused an import, emptying the nodes' image stores: {str(error)[-300:]}")
            for node in NODES:
                shutil.rmtree(image_store(node), ignore_errors=True)
        except BaseException:
            if cluster is not None:
                down(cluster.root)
            raise
    raise AssertionError("unreachable")


def _teardown(cluster: RealCluster) -> None:
    """Pods first (through their kubelets, so CNI releases their addresses), then every process we
    started, then what they left on the machine. Each step runs even if an earlier one failed."""
    root, pids = cluster.root, cluster.pids
    started = time.monotonic()

    def progress(message: str) -> None:
        say(f"teardown: {message} ({time.monotonic() - started:.1f}s)")

    if cluster.kubeconfig and _alive(pids.get("controlplane:kube-apiserver", 0)):
        _stop(pids.get("controlplane:kube-controller-manager", 0))  # nothing recreates deleted pods now
        with contextlib.suppress(Exception):
            cluster.kubectl().run(
                "delete", "pods", "--all", "--all-namespaces", "--grace-period=0", "--force", "--wait=false"
            )
            _wait("the kubelets to stop every pod", lambda: not _running_tasks(cluster), 60, interval_s=0.5)
        progress("pods stopped")
    for name in [n for n in pids if not n.startswith("controlplane:")][::-1]:
        if name.startswith("containerd:") and _alive(pids[name]):
            _kill_tasks(str(root / name.split(":", 1)[1] / "containerd" / "containerd.sock"))
        _stop(pids[name])
    _kill_shims(root)
    for node in NODES:
        host.kill_cgroup_processes(cgroup_root(node))
    progress("kube-proxy, kubelets and containerd stopped")
    with contextlib.suppress(Exception):
        controlplane.down(root / "controlplane")
    progress("control plane stopped")
    kube_proxy = cluster.bin_dir / "kube-proxy"
    if kube_proxy.exists():
        subprocess.run([str(kube_proxy), "--cleanup"], capture_output=True, timeout=60)
    host.remove_kube_chains()
    host.unmount_under(root)
    for node in NODES:
        host.unmount_under(image_store(node))
    host.remove_netns(host.netns_names() - set(cluster.netns_before))
    for node in NODES:
        _wait_quietly(lambda node=node: host.remove_cgroup_root(cgroup_root(node)) or not _cgroups_left(node))
    host.remove_log_links(root)
    host.guard_down()
    host.bridge_down()
    host.remove_new_tables(set(cluster.tables_before))
    host.write_sysctls(cluster.sysctls)
    progress("iptables chains, mounts, cgroups, bridge, guard and sysctls put back")


def _cgroups_left(node: NodeSpec) -> bool:
    return any((h / cgroup_root(node).strip("/")).exists() for h in host.cgroup_hierarchies(unified=True))


def _wait_quietly(check, timeout_s: float = 10) -> None:
    """A killed process leaves its cgroup only once the kernel has reaped it: retry briefly."""
    with contextlib.suppress(TimeoutError):
        _wait("cgroups to empty", check, timeout_s, interval_s=0.2)


def _running_tasks(cluster: RealCluster) -> bool:
    for address in cluster.containerd_addresses:
        result = subprocess.run(
            ["ctr", "--address", address, "-n", "k8s.io", "tasks", "ls", "-q"], capture_output=True, text=True
        )
        if result.returncode == 0 and result.stdout.strip():
            return True
    return False


def _kill_tasks(address: str) -> None:
    """Containers a kubelet did not stop in time: killed through their containerd."""
    listing = subprocess.run(
        ["ctr", "--address", address, "-n", "k8s.io", "tasks", "ls", "-q"], capture_output=True, text=True
    )
    for task in listing.stdout.split():
        subprocess.run(
            ["ctr", "--address", address, "-n", "k8s.io", "tasks", "kill", "-a", "-s", "SIGKILL", task],
            capture_output=True,
        )


def _kill_shims(root: Path) -> None:
    """containerd's shims outlive containerd; those of our nodes (their address is under `root`) go."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            if b"containerd-shim" in cmdline[0] and any(str(root).encode() in part for part in cmdline):
                os.kill(int(proc.name), signal.SIGKILL)
