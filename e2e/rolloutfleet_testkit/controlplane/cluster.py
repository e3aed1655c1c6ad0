"""`up`, `down` and `status` of the local control plane: etcd, kube-apiserver, controller-manager and
scheduler as local processes on 127.0.0.1 with RBAC, and a kubeconfig for kubectl and clients.

`down` ends only the processes that `up` recorded, by PID, and removes their state.
"""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from rolloutfleet_testkit.cache import project_cache
from rolloutfleet_testkit.processes import free_ports
from rolloutfleet_testkit.waiting import log_tail, wait_for

from . import audit
from .build import ensure_binaries
from .pki import Pki, create_pki, kubeconfig

SERVICE_CIDR = "10.0.0.0/24"
STATE_FILE = "state.json"


def default_dir() -> Path:
    cache = project_cache()
    return cache / "cluster"


def say(message: str) -> None:
    print(f"[cluster] {message}", flush=True)


@dataclass
class ClusterState:
    directory: str
    kubeconfig: str
    apiserver_url: str
    ports: dict[str, int]
    pids: dict[str, int] = field(default_factory=dict)

    def save(self) -> None:
        (Path(self.directory) / STATE_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, directory: Path) -> ClusterState | None:
        path = directory / STATE_FILE
        return cls(**json.loads(path.read_text())) if path.exists() else None


LOOPBACK = "127.0.0.1"


def component_args(
    name: str, bins: Path, root: Path, pki: Pki, ports: dict[str, int], address: str = LOOPBACK
) -> list[str]:
    """Command line of one component: a pure function of where things are. The API server listens on
    `address`; any other than loopback is one that pods (on real nodes) reach it at, so it is
    advertised as the `kubernetes` Service's endpoint and the API server talks to kubelets."""
    etcd_url = f"http://127.0.0.1:{ports['etcd']}"
    common_auth = [
        f"--kubeconfig={root / f'{name}.kubeconfig'}",
        f"--authentication-kubeconfig={root / f'{name}.kubeconfig'}",
        f"--authorization-kubeconfig={root / f'{name}.kubeconfig'}",
        "--leader-elect=false",
        "--bind-address=127.0.0.1",
    ]
    if name == "etcd":
        return [
            str(bins / "etcd"),
            f"--data-dir={root / 'etcd'}",
            f"--listen-client-urls={etcd_url}",
            f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls=http://127.0.0.1:{ports['etcd-peer']}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{ports['etcd-peer']}",
            f"--initial-cluster=default=http://127.0.0.1:{ports['etcd-peer']}",
            "--unsafe-no-fsync",
            "--log-level=warn",
        ]
    if name == "kube-apiserver":
        # A loopback advertise address is refused by the endpoint reconciler: without nodes there is
        # none to reconcile; with nodes the `kubernetes` Service must point where pods reach it.
        node_facing = (
            [
                "--endpoint-reconciler-type=lease",
                "--kubelet-preferred-address-types=InternalIP",
                f"--kubelet-client-certificate={pki.path('apiserver-kubelet-client.crt')}",
                f"--kubelet-client-key={pki.path('apiserver-kubelet-client.key')}",
                # The kubelets serve certificates of the cluster's CA (pki.create_pki's nodes).
                f"--kubelet-certificate-authority={pki.ca_cert}",
            ]
            if address != LOOPBACK
            else ["--endpoint-reconciler-type=none"]
        )
        return [
            str(bins / "kube-apiserver"),
            f"--etcd-servers={etcd_url}",
            f"--bind-address={address}",
            f"--secure-port={ports['kube-apiserver']}",
            f"--advertise-address={address}",
            *node_facing,
            f"--tls-cert-file={pki.path('apiserver.crt')}",
            f"--tls-private-key-file={pki.path('apiserver.key')}",
            f"--client-ca-file={pki.ca_cert}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--authorization-mode=RBAC",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki.path('sa.pub')}",
            f"--service-account-signing-key-file={pki.path('sa.key')}",
            "--allow-privileged=true",
            f"--cert-dir={root / 'apiserver-certs'}",
            *audit.apiserver_args(root),
        ]
    if name == "kube-controller-manager":
        return [
            str(bins / name),
            *common_auth,
            f"--secure-port={ports[name]}",
            f"--service-account-private-key-file={pki.path('sa.key')}",
            f"--root-ca-file={pki.ca_cert}",
            "--use-service-account-credentials=true",
            f"--cluster-signing-cert-file={pki.ca_cert}",
            f"--cluster-signing-key-file={pki.path('ca.key')}",
        ]
    if name == "kube-scheduler":
        return [str(bins / name), *common_auth, f"--secure-port={ports[name]}"]
    raise ValueError(f"unknown component {name}")


def _start(name: str, args: list[str], logs: Path) -> int:
    log = open(logs / f"{name}.log", "ab")  # noqa: SIM115 (handed to the child)
    process = subprocess.Popen(
        args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
    )
    log.close()
    return process.pid


def _wait(url: str, timeout_s: float, client: httpx.Client, what: str, logs: Path) -> None:
    last = [""]

    def answers_200() -> bool:
        try:
            response = client.get(url, timeout=2)
        except httpx.HTTPError as exc:
            last[0] = type(exc).__name__
            return False
        last[0] = f"{response.status_code} {response.text[:200]}"
        return response.status_code == 200

    def detail() -> str:
        return f" at {url} ({last[0]}){log_tail(logs / f'{what}.log')}"

    wait_for(answers_200, timeout_s, f"{what} to be ready", 0.1, detail=detail)


def up(
    directory: Path | None = None,
    timeout_s: float = 120,
    address: str = LOOPBACK,
    nodes: tuple[str, ...] = (),
) -> ClusterState:
    """Start a fresh control plane in `directory` (default: the cache's cluster/). With an `address`
    other than loopback the API server listens there (where pods reach it) and the PKI holds client
    certificates for `nodes` (rolloutfleet_testkit.node starts them)."""
    root = (directory or default_dir()).resolve()
    existing = ClusterState.load(root)
    if existing and any(_alive(pid) for pid in existing.pids.values()):
        raise RuntimeError(f"a cluster is already running from {root}; run `down` first")
    bins = ensure_binaries()
    started = time.monotonic()
    if root.exists():
        _remove_tree(root)
    logs = root / "logs"
    logs.mkdir(parents=True)
    audit.write_policy(root)
    say(f"certificates and keys in {root / 'pki'}")
    server_ips = (address,) if address != LOOPBACK else ()
    pki = create_pki(root / "pki", server_ips=server_ips, nodes=nodes)
    names = ("etcd", "etcd-peer", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
    ports = dict(zip(names, free_ports(len(names)), strict=True))
    server = f"https://{address}:{ports['kube-apiserver']}"
    for stem, name in (
        ("admin", "admin"),
        ("controller-manager", "kube-controller-manager"),
        ("scheduler", "kube-scheduler"),
    ):
        (root / f"{name}.kubeconfig").write_text(kubeconfig(server, pki, stem))
    state = ClusterState(str(root), str(root / "admin.kubeconfig"), server, ports)
    admin_crt, admin_key = pki.client("admin")
    context = ssl.create_default_context(cafile=str(pki.ca_cert))
    context.load_cert_chain(str(admin_crt), str(admin_key))
    insecure = httpx.Client(verify=False)
    with httpx.Client(verify=context) as admin:
        for name, url, client in (
            ("etcd", f"http://127.0.0.1:{ports['etcd']}/health", insecure),
            ("kube-apiserver", f"{server}/readyz", admin),
            (
                "kube-controller-manager",
                f"https://127.0.0.1:{ports['kube-controller-manager']}/healthz",
                insecure,
            ),
            ("kube-scheduler", f"https://127.0.0.1:{ports['kube-scheduler']}/healthz", insecure),
        ):
            state.pids[name] = _start(name, component_args(name, bins, root, pki, ports, address), logs)
            state.save()
            _wait(url, timeout_s, client, name, logs)
            say(f"{name} ready ({time.monotonic() - started:.1f}s)")
    insecure.close()
    say(f"control plane up in {time.monotonic() - started:.1f}s; export KUBECONFIG={state.kubeconfig}")
    return state


def _alive(pid: int) -> bool:
    # When `up` ran in this process (tests), an exited component is our zombie until reaped, and a
    # zombie still answers kill(pid, 0): reap it first.
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:
        pass  # not our child (`up` ran in another process): init reaps it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # Started by an `up` in a process that has exited, it is init's child: a zombie until init reaps
    # it (seconds, on some machines), and exited all the same.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _remove_tree(root: Path) -> None:
    import shutil

    shutil.rmtree(root)


def down(directory: Path | None = None, timeout_s: float = 20) -> None:
    """Stop the processes `up` recorded (SIGTERM, then SIGKILL) and remove the cluster's state."""
    root = (directory or default_dir()).resolve()
    state = ClusterState.load(root)
    if state is None:
        say(f"no cluster recorded in {root}")
        return
    for name in reversed(list(state.pids)):  # scheduler and controller-manager before apiserver and etcd
        pid = state.pids[name]
        if not _alive(pid):
            continue
        os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _alive(pid):
            os.killpg(pid, signal.SIGKILL)
        say(f"stopped {name} (pid {pid})")
    _remove_tree(root)


def status(directory: Path | None = None) -> dict[str, str]:
    root = (directory or default_dir()).resolve()
    state = ClusterState.load(root)
    if state is None:
        return {}
    return {
        name: ("running" if _alive(pid) else "stopped") + f" (pid {pid})" for name, pid in state.pids.items()
    }
