"""Simulated nodes on the local control plane: KWOK's controller (`kwok`, built from the Go module
proxy by build.ensure_kwok) makes Node objects look like live nodes and the pods scheduled onto them
look Running and Ready. No kubelet and no container runs: a fleet of a thousand proxies costs the
API server and the operator what it would on a real cluster, and this machine almost nothing else.

KWOK acts only as its stages say (its built-in defaults belong to kwokctl, not to the controller).
`stages()` writes the four this kit needs, from KWOK's Stage API (kwok.x-k8s.io/v1alpha1; the
templates are Go templates over the object, with KWOK's functions Now, Quote, NodeIP, PodIPsWith,
NodeIPsWith; a rendered status is applied as a strategic merge patch, so conditions merge by type):
- node-ready: a node not yet Ready becomes Ready (the node-lifecycle controller then lifts the
  not-ready taint that admission put on it), with its address and version info;
- node-heartbeat: a Ready node's conditions are refreshed every few minutes; its Lease, renewed by
  the controller (--node-lease-duration-seconds), is what keeps it from being marked unreachable;
- pod-ready: a scheduled pending pod becomes Running with every condition and container Ready, with
  a pod IP from --cidr (an address nothing answers at: no process runs behind it);
- pod-delete: a pod being deleted is removed at once (what a kubelet does once its containers exit).

Nodes are ordinary Node objects created here with large capacity and the annotation KWOK manages
(`--manage-nodes-with-annotation-selector`); a GPU node carries the `nvidia.com/gpu` label, taint
and capacity GPU pods are scheduled by, as the real test node does.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rolloutfleet_testkit.kubectl import Kubectl
from rolloutfleet_testkit.processes import ServerProcess
from rolloutfleet_testkit.waiting import log_tail, wait_for

from . import audit, cluster
from .build import ensure_binaries, ensure_kwok

MANAGED_ANNOTATION = "kwok.x-k8s.io/node"
MANAGED_VALUE = "fake"
NODE_LABEL = "rolloutfleet.dev/simulated-node"
GPU_RESOURCE = "nvidia.com/gpu"
# Simulated pod addresses: apart from the services' 10.0.0.0/24 and the real nodes' 10.88.0.0/16,
# and large enough for thousands of pods. Nothing listens there.
POD_CIDR = "10.128.0.0/14"
NODE_IP = "10.127.0.1"
LEASE_SECONDS = 40  # the node-lifecycle controller's grace period is 50 s
HEARTBEAT_MS = 240_000
STAGE_API = "kwok.x-k8s.io/v1alpha1"

_NOT_DELETING = {"key": ".metadata.deletionTimestamp", "operator": "DoesNotExist"}
_READY_STATUS = '.status.conditions.[] | select( .type == "Ready" ) | .status'

# A node's conditions as a healthy kubelet reports them (type, status, reason).
NODE_CONDITIONS = (
    ("Ready", "True", "KubeletReady"),
    ("MemoryPressure", "False", "KubeletHasSufficientMemory"),
    ("DiskPressure", "False", "KubeletHasNoDiskPressure"),
    ("PIDPressure", "False", "KubeletHasSufficientPID"),
    ("NetworkUnavailable", "False", "RouteCreated"),
)


def _node_conditions_template() -> str:
    lines = ["{{ $now := Now }}", "conditions:"]
    for kind, status, reason in NODE_CONDITIONS:
        lines += [
            f"- type: {kind}",
            f'  status: "{status}"',
            f"  reason: {reason}",
            "  lastHeartbeatTime: {{ $now | Quote }}",
            "  lastTransitionTime: {{ $now | Quote }}",
        ]
    return "\n".join(lines) + "\n"


NODE_READY_TEMPLATE = (
    _node_conditions_template()
    + """addresses:
- type: InternalIP
  address: {{ NodeIP | Quote }}
- type: Hostname
  address: {{ .metadata.name | Quote }}
nodeInfo:
  architecture: amd64
  operatingSystem: linux
  kubeletVersion: simulated
  kubeProxyVersion: simulated
  containerRuntimeVersion: simulated
phase: Running
"""
)

POD_CONDITIONS = ("PodScheduled", "PodReadyToStartContainers", "Initialized", "ContainersReady", "Ready")

POD_READY_TEMPLATE = (
    """{{ $now := Now }}
phase: Running
startTime: {{ $now | Quote }}
conditions:
"""
    + "".join(
        f'- type: {kind}\n  status: "True"\n  lastTransitionTime: {{{{ $now | Quote }}}}\n'
        for kind in POD_CONDITIONS
    )
    + """containerStatuses:
{{ range .spec.containers }}
- name: {{ .name | Quote }}
  image: {{ .image | Quote }}
  ready: true
  started: true
  restartCount: 0
  state:
    running:
      startedAt: {{ $now | Quote }}
{{ end }}
{{ with NodeIPsWith .spec.nodeName }}
hostIP: {{ index . 0 | Quote }}
hostIPs:
{{ range . }}
- ip: {{ . | Quote }}
{{ end }}
{{ end }}
{{ $meta := .metadata }}
{{ with PodIPsWith .spec.nodeName ( or .spec.hostNetwork false ) $meta.uid $meta.name $meta.namespace }}
podIP: {{ index . 0 | Quote }}
podIPs:
{{ range . }}
- ip: {{ . | Quote }}
{{ end }}
{{ end }}
"""
)


def _stage(name: str, kind: str, expressions: list[dict], next_: dict, delay_ms: int = 0) -> dict:
    spec: dict[str, Any] = {
        "resourceRef": {"apiGroup": "v1", "kind": kind},
        "selector": {"matchExpressions": expressions},
        "next": next_,
    }
    if delay_ms:
        # Spread over [delay, delay + jitter] so the nodes' refreshes do not come at once.
        spec["delay"] = {"durationMilliseconds": delay_ms, "jitterDurationMilliseconds": delay_ms + 10_000}
    return {"apiVersion": STAGE_API, "kind": "Stage", "metadata": {"name": name}, "spec": spec}


def stages() -> list[dict]:
    """KWOK's Stage objects for Ready nodes and Ready pods (pure; module docstring)."""
    return [
        _stage(
            "node-ready",
            "Node",
            [{"key": _READY_STATUS, "operator": "NotIn", "values": ["True"]}],
            {"statusTemplate": NODE_READY_TEMPLATE},
        ),
        _stage(
            "node-heartbeat",
            "Node",
            [
                {"key": ".status.phase", "operator": "In", "values": ["Running"]},
                {"key": _READY_STATUS, "operator": "In", "values": ["True"]},
            ],
            {"statusTemplate": _node_conditions_template()},
            delay_ms=HEARTBEAT_MS,
        ),
        _stage(
            "pod-ready",
            "Pod",
            [
                _NOT_DELETING,
                {"key": ".spec.nodeName", "operator": "Exists"},
                {"key": ".status.phase", "operator": "In", "values": ["Pending"]},
            ],
            {"statusTemplate": POD_READY_TEMPLATE},
        ),
        _stage(
            "pod-delete",
            "Pod",
            [{"key": ".metadata.deletionTimestamp", "operator": "Exists"}],
            {"delete": True},
        ),
    ]


def fake_node(
    name: str, cpu: str = "64", memory: str = "512Gi", pods: int = 250, gpus: int = 0
) -> dict[str, Any]:
    """A Node for KWOK to manage, with its capacity; with `gpus`, a GPU node (pure)."""
    capacity = {"cpu": cpu, "memory": memory, "pods": str(pods)}
    labels = {NODE_LABEL: "true", "kubernetes.io/hostname": name, "kubernetes.io/os": "linux"}
    spec: dict[str, Any] = {}
    if gpus:
        capacity[GPU_RESOURCE] = str(gpus)
        labels[GPU_RESOURCE] = "true"
        spec["taints"] = [{"key": GPU_RESOURCE, "value": "true", "effect": "NoSchedule"}]
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels, "annotations": {MANAGED_ANNOTATION: MANAGED_VALUE}},
        "spec": spec,
        "status": {"capacity": capacity, "allocatable": capacity},
    }


def kwok_args(binary: Path, kubeconfig: str, config: Path) -> list[str]:
    """The controller's command line (pure)."""
    return [
        str(binary),
        f"--kubeconfig={kubeconfig}",
        f"--config={config}",
        f"--manage-nodes-with-annotation-selector={MANAGED_ANNOTATION}={MANAGED_VALUE}",
        f"--cidr={POD_CIDR}",
        f"--node-ip={NODE_IP}",
        f"--node-lease-duration-seconds={LEASE_SECONDS}",
    ]


def ready_nodes(nodes: dict[str, Any]) -> list[str]:
    """Names of the Ready nodes in a `kubectl get nodes -o json` listing (pure)."""
    return [
        node["metadata"]["name"]
        for node in nodes.get("items", [])
        if any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in (node.get("status") or {}).get("conditions") or ()
        )
        and not any(t.get("key") == "node.kubernetes.io/not-ready" for t in node["spec"].get("taints") or ())
    ]


@dataclass
class SimulatedCluster:
    kubeconfig: str
    bin_dir: Path
    audit_log: Path
    kwok: ServerProcess
    nodes: list[str]

    def kubectl(self, namespace: str | None = None) -> Kubectl:
        return Kubectl(self.bin_dir / "kubectl", self.kubeconfig, namespace)


@contextlib.contextmanager
def simulated_cluster(work: Path, nodes: int = 20, gpu_nodes: int = 0) -> Iterator[SimulatedCluster]:
    """The local control plane (in `work`) with `nodes` simulated CPU nodes and `gpu_nodes` GPU
    nodes managed by KWOK, all Ready; stopped and removed afterwards (also on failure)."""
    binary = ensure_kwok()
    bin_dir = ensure_binaries()
    root = work / "controlplane"
    state = cluster.up(root)
    try:
        config = work / "kwok-stages.yaml"
        config.write_text(yaml.safe_dump_all(stages(), sort_keys=False))
        args = kwok_args(binary, state.kubeconfig, config)
        with ServerProcess(args, work / "kwok.log") as kwok:
            kubectl = Kubectl(bin_dir / "kubectl", state.kubeconfig)
            names = [f"kwok-node-{i}" for i in range(nodes)]
            manifests = [fake_node(n) for n in names]
            for i in range(gpu_nodes):
                names.append(f"kwok-gpu-node-{i}")
                manifests.append(fake_node(names[-1], gpus=8))
            kubectl("create", "-f", "-", input="\n---\n".join(json.dumps(m) for m in manifests))
            started = time.monotonic()

            def all_ready() -> bool:
                if kwok.process.poll() is not None:
                    raise RuntimeError(f"kwok exited:{log_tail(kwok.log_path)}")
                return len(ready_nodes(json.loads(kubectl("get", "nodes", "-o", "json")))) == len(names)

            wait_for(all_ready, 120, f"{len(names)} simulated nodes to be Ready", 0.5)
            cluster.say(f"{len(names)} simulated nodes Ready in {time.monotonic() - started:.1f}s (KWOK)")
            yield SimulatedCluster(state.kubeconfig, bin_dir, root / audit.LOG_FILE, kwok, names)
    finally:
        cluster.down(root)
