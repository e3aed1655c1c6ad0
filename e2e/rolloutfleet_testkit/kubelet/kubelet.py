"""ProcessKubelet: the harness as a whole — nodes, pod watches, pod workers, volume provisioner."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from pathlib import Path

from .addresses import AddressBlockLock, AddressPool
from .cluster_dns import ClusterDns
from .credentials import api_server
from .heartbeat import NodeHeartbeat
from .kube import Informer, Kube, load_configuration, pod_path
from .nodes import DEFAULT_NODES, NodeSpec
from .pod import NodeContext, PodWorker
from .provisioner import Provisioner
from .status import TERMINAL_PHASES

log = logging.getLogger("rolloutfleet.kubelet")


class ProcessKubelet:
    """A TEST HARNESS standing in for kubelets: runs the pods bound to its nodes as local processes.

    >>> kubelet = ProcessKubelet("/path/admin.kubeconfig", "/tmp/kubelet-state").start()
    >>> ...  # pods scheduled to rf-cpu-node / rf-gpu-node now run
    >>> kubelet.stop()  # kills the pods' processes and deletes the Nodes
    """

    def __init__(
        self,
        kubeconfig: str | Path,
        state_dir: str | Path,
        nodes: Sequence[NodeSpec] = DEFAULT_NODES,
        provision_volumes: bool = True,
    ):
        self.kubeconfig = str(kubeconfig)
        self.state_dir = Path(state_dir).resolve()
        self.nodes = list(nodes)
        self._provision_volumes = provision_volumes
        self._workers: dict[str, PodWorker] = {}
        self._finished: set[str] = set()  # uids whose worker ended: never run again
        self._lock = threading.Lock()
        self._informers: list[Informer] = []
        self._heartbeat: NodeHeartbeat | None = None
        self._provisioner: Provisioner | None = None
        self._dns: ClusterDns | None = None
        self._block: AddressBlockLock | None = None
        self._kube: Kube | None = None
        self._context: NodeContext | None = None
        self._stopped = False

    def start(self, timeout_s: float = 60) -> ProcessKubelet:
        """Register the nodes, wait until they are schedulable, start running pods."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        configuration = load_configuration(self.kubeconfig)
        self._kube = Kube(configuration)
        allocatable = {spec.name: spec.resources for spec in self.nodes}
        self._block = AddressBlockLock()
        self._dns = ClusterDns(self._kube, self.state_dir / "cluster-dns" / "hosts").start()
        self._context = NodeContext(
            kube=self._kube,
            state_dir=self.state_dir,
            api_server=api_server(configuration, self.state_dir),
            addresses=AddressPool(self._block.first, self._block.last),
            allocatable=lambda node: allocatable.get(node, {}),
            forget=self._forget,
            hosts_file=self._dns.path,
        )
        self._heartbeat = NodeHeartbeat(self._kube, self.nodes).start()
        if self._provision_volumes:
            self._provisioner = Provisioner(self._kube, configuration, self.state_dir).start()
        for spec in self.nodes:
            informer = Informer(
                configuration,
                lambda api: api.list_pod_for_all_namespaces,
                self._on_pod,
                f"pods-{spec.name}",
                field_selector=f"spec.nodeName={spec.name}",
            )
            self._informers.append(informer.start())
        self._heartbeat.wait_schedulable(timeout_s)
        log.info(
            "process kubelet running nodes %s (state in %s)", [n.name for n in self.nodes], self.state_dir
        )
        return self

    def stop(self, delete_nodes: bool = True) -> None:
        """Kill every pod process, stop watching, delete the Node objects."""
        if self._stopped:
            return
        self._stopped = True
        for informer in self._informers:
            informer.stop()
        with self._lock:
            workers = list(self._workers.values())
        threads = [threading.Thread(target=w.shutdown, daemon=True) for w in workers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if self._provisioner is not None:
            self._provisioner.stop()
        if self._dns is not None:
            self._dns.stop()
        if self._heartbeat is not None:
            self._heartbeat.stop(delete_nodes)
        if self._kube is not None:
            self._kube.close()
        if self._block is not None:
            self._block.release()

    def __enter__(self) -> ProcessKubelet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_path(self, namespace: str, pod: str, container: str) -> Path:
        """The file a container's stdout and stderr go to (appended across restarts)."""
        return self.state_dir / "logs" / f"{namespace}_{pod}_{container}.log"

    def pod_ips(self) -> set[str]:
        return self._context.addresses.in_use() if self._context else set()

    # ---- pod events ------------------------------------------------------------------------------

    def _forget(self, uid: str) -> None:
        with self._lock:
            self._workers.pop(uid, None)
            self._finished.add(uid)

    def _on_pod(self, kind: str, pod: dict) -> None:
        meta = pod["metadata"]
        uid = meta["uid"]
        with self._lock:
            worker = self._workers.get(uid)
            if worker is None and kind != "DELETED" and self._should_run(pod, uid):
                worker = self._workers[uid] = PodWorker(pod, self._context)  # type: ignore[arg-type]
                worker.start()
                return
        if worker is None:
            if kind != "DELETED" and meta.get("deletionTimestamp"):
                self._remove(pod)  # nothing runs for it: let it go at once
            return
        if kind == "DELETED":
            worker.deleted()
        else:
            worker.update(pod)

    def _should_run(self, pod: dict, uid: str) -> bool:
        phase = (pod.get("status") or {}).get("phase")
        return (
            uid not in self._finished
            and phase not in TERMINAL_PHASES
            and not pod["metadata"].get("deletionTimestamp")
        )

    def _remove(self, pod: dict) -> None:
        meta = pod["metadata"]
        assert self._kube is not None
        try:
            self._kube.delete(
                pod_path(meta["namespace"], meta["name"]),
                {"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}},
            )
        except Exception as exc:
            log.debug("removing pod %s/%s: %s", meta["namespace"], meta["name"], exc)
