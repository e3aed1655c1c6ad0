"""Registering the harness's Nodes and keeping them alive (a thread).

The node-lifecycle controller judges a node by its Lease in kube-node-lease and its Ready
condition: new Nodes get the `node.kubernetes.io/not-ready` NoSchedule taint at admission, which
the controller removes once the node reports Ready, and a node whose Lease stops being renewed is
marked NotReady and its pods evicted. So: Ready status patched every 10 s, Lease renewed as often.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Sequence

from .kube import MERGE, STRATEGIC, Kube
from .nodes import (
    LEASE_NAMESPACE,
    NodeSpec,
    lease_manifest,
    micro_time,
    node_labels,
    node_manifest,
    node_status,
    node_taints,
)
from .status import timestamp

log = logging.getLogger("rolloutfleet.kubelet")

HEARTBEAT_S = 10.0
NOT_READY_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")


class NodeHeartbeat:
    def __init__(self, kube: Kube, specs: Sequence[NodeSpec], interval_s: float = HEARTBEAT_S):
        self._kube = kube
        self._specs = list(specs)
        self._interval_s = interval_s
        self._boot_id = secrets.token_hex(16)
        self._since = timestamp()
        self._uids: dict[str, str] = {}
        self._stop = threading.Event()
        self._version = "v0.0.0"
        self.thread = threading.Thread(target=self._run, name="node-heartbeat", daemon=True)

    def start(self) -> NodeHeartbeat:
        self._version = (self._kube.get("/version") or {}).get("gitVersion", self._version)
        for spec in self._specs:
            self._register(spec)
            self._beat(spec)
        self.thread.start()
        return self

    def stop(self, delete_nodes: bool = True) -> None:
        self._stop.set()
        self.thread.join(timeout=15)
        if delete_nodes:
            for spec in self._specs:
                try:
                    self._kube.delete(f"/api/v1/nodes/{spec.name}")
                    self._kube.delete(
                        f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases/{spec.name}"
                    )
                except Exception as exc:  # the API server may already be gone at teardown
                    log.warning("could not delete node %s: %s", spec.name, exc)

    def wait_schedulable(self, timeout_s: float) -> None:
        """Block until every node is Ready without the not-ready taint (the lifecycle controller's work)."""
        deadline = time.monotonic() + timeout_s
        pending: list[str] = []
        while time.monotonic() < deadline:
            pending = []
            for spec in self._specs:
                node = self._kube.get(f"/api/v1/nodes/{spec.name}") or {}
                taints = {t.get("key") for t in (node.get("spec") or {}).get("taints") or []}
                if not node or taints & set(NOT_READY_TAINTS):
                    pending.append(spec.name)
            if not pending:
                return
            time.sleep(0.25)
        raise TimeoutError(f"nodes {pending} still tainted not-ready after {timeout_s}s")

    def _register(self, spec: NodeSpec) -> None:
        created = self._kube.create("/api/v1/nodes", node_manifest(spec, self._version, self._boot_id))
        if created is None:  # left over from an earlier run: make it ours again
            patch = {"metadata": {"labels": node_labels(spec)}, "spec": {"taints": node_taints(spec)}}
            created = self._kube.patch(f"/api/v1/nodes/{spec.name}", patch, MERGE)
        self._uids[spec.name] = (created or {}).get("metadata", {}).get("uid", "")

    def _beat(self, spec: NodeSpec) -> None:
        status = node_status(spec, self._version, self._boot_id, timestamp(), self._since)
        if self._kube.patch(f"/api/v1/nodes/{spec.name}/status", {"status": status}, STRATEGIC) is None:
            self._register(spec)  # someone deleted the node: register again, as a kubelet does
        path = f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases/{spec.name}"
        lease = lease_manifest(spec.name, self._uids.get(spec.name), micro_time())
        if self._kube.patch(path, {"spec": lease["spec"]}, MERGE) is None:
            self._kube.create(f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases", lease)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            for spec in self._specs:
                try:
                    self._beat(spec)
                except Exception as exc:  # API errors and connection errors alike: try again next beat
                    log.warning("heartbeat for %s failed: %s", spec.name, exc)
