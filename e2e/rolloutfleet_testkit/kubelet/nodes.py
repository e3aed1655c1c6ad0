"""The harness's two Nodes and their Leases as API objects (pure).

A CPU node and a GPU node: the GPU node advertises `nvidia.com/gpu` like the NVIDIA device plugin
would, carries the GPU-feature-discovery label and the NoSchedule taint GPU pools usually have, so
only pods that tolerate it and select it land there.
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass, field

from .status import timestamp

CPU_NODE = "rf-cpu-node"
GPU_NODE = "rf-gpu-node"
GPU_RESOURCE = "nvidia.com/gpu"
GPU_LABEL = "nvidia.com/gpu.present"
GPU_TAINT = {"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"}
NODE_IP = "127.0.0.1"
LEASE_NAMESPACE = "kube-node-lease"
LEASE_DURATION_S = 40
HARNESS_LABEL = "rolloutfleet.dev/process-kubelet"
KUBELET_PORT = 10250  # advertised only; nothing listens there (no logs/exec)


@dataclass(frozen=True)
class NodeSpec:
    name: str
    gpus: int = 0
    cpu: str = "8"
    memory: str = "32Gi"
    pods: str = "110"
    extra_labels: dict[str, str] = field(default_factory=dict)

    @property
    def resources(self) -> dict[str, str]:
        resources = {"cpu": self.cpu, "memory": self.memory, "pods": self.pods, "ephemeral-storage": "100Gi"}
        if self.gpus:
            resources[GPU_RESOURCE] = str(self.gpus)
        return resources


DEFAULT_NODES = (NodeSpec(CPU_NODE), NodeSpec(GPU_NODE, gpus=4))


def go_arch(machine: str | None = None) -> str:
    machine = (machine or platform.machine()).lower()
    return {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(machine, machine)


def node_labels(spec: NodeSpec) -> dict[str, str]:
    labels = {
        "kubernetes.io/hostname": spec.name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": go_arch(),
        "beta.kubernetes.io/os": "linux",
        "beta.kubernetes.io/arch": go_arch(),
        HARNESS_LABEL: "true",
        **spec.extra_labels,
    }
    if spec.gpus:
        labels[GPU_LABEL] = "true"
    return labels


def node_taints(spec: NodeSpec) -> list[dict]:
    return [dict(GPU_TAINT)] if spec.gpus else []


def node_conditions(now: str, since: str) -> list[dict]:
    """Healthy-node conditions; `since` is their lastTransitionTime (registration), `now` the heartbeat."""

    def condition(kind: str, ok_status: str, reason: str, message: str) -> dict:
        return {
            "type": kind,
            "status": ok_status,
            "reason": reason,
            "message": message,
            "lastHeartbeatTime": now,
            "lastTransitionTime": since,
        }

    return [
        condition("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory"),
        condition("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
        condition("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
        condition("Ready", "True", "KubeletReady", "process kubelet (test harness) is posting ready status"),
    ]


def node_info(spec: NodeSpec, kubelet_version: str, boot_id: str) -> dict:
    return {
        "machineID": f"process-kubelet-{spec.name}",
        "systemUUID": f"process-kubelet-{spec.name}",
        "bootID": boot_id,
        "kernelVersion": platform.release(),
        "osImage": "RolloutFleet process kubelet (test harness)",
        "containerRuntimeVersion": "process://0.1.0",
        "kubeletVersion": kubelet_version,
        "kubeProxyVersion": "",
        "operatingSystem": "linux",
        "architecture": go_arch(),
    }


def node_status(spec: NodeSpec, kubelet_version: str, boot_id: str, now: str, since: str) -> dict:
    return {
        "capacity": spec.resources,
        "allocatable": spec.resources,
        "conditions": node_conditions(now, since),
        "addresses": [{"type": "InternalIP", "address": NODE_IP}, {"type": "Hostname", "address": spec.name}],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": KUBELET_PORT}},
        "nodeInfo": node_info(spec, kubelet_version, boot_id),
    }


def node_manifest(spec: NodeSpec, kubelet_version: str, boot_id: str, now: str | None = None) -> dict:
    now = now or timestamp()
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": spec.name, "labels": node_labels(spec)},
        "spec": {"taints": node_taints(spec)},
        "status": node_status(spec, kubelet_version, boot_id, now, now),
    }


def micro_time(epoch: float | None = None) -> str:
    """MicroTime, as Leases' renewTime requires."""
    epoch = time.time() if epoch is None else epoch
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(epoch)) + f".{int(epoch % 1 * 1e6):06d}Z"


def lease_manifest(node_name: str, node_uid: str | None, renew_time: str) -> dict:
    metadata: dict = {"name": node_name, "namespace": LEASE_NAMESPACE}
    if node_uid:  # as a kubelet does: the Lease goes away with its Node
        metadata["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": node_uid}
        ]
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": metadata,
        "spec": {
            "holderIdentity": node_name,
            "leaseDurationSeconds": LEASE_DURATION_S,
            "renewTime": renew_time,
        },
    }
