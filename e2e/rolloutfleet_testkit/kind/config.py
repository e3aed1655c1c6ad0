"""What a kind cluster here is made of, as pure functions: the cluster config, the per-node CNI
config and routes that stand in for kindnetd, and the runtime wrapper Docker needs on this machine."""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass

import yaml

from rolloutfleet_testkit.node.config import GPU_LABEL, GPU_RESOURCE

KIND_VERSION = "v0.33.0"
CLUSTER_NAME = "rolloutfleet"
POD_SUBNET = "10.244.0.0/16"  # kind's default; the controller manager gives each node a /24 of it
GPU_TAINT = {"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"}
CNI_FILE = "/etc/cni/net.d/10-rolloutfleet.conflist"
RUNTIME_NAME = "nosysres"
# Debian's Docker 20.10 gives privileged containers (kind's nodes) and `docker exec` every
# capability; root's bounding set here lacks CAP_SYS_RESOURCE, so runc fails "unable to apply caps".
MISSING_CAPABILITY = "CAP_SYS_RESOURCE"
# Names the directory of this machine every node mounts at the same path: hostPath volumes the
# tests make there (the test tokenizer, dump directories) are then the same on the nodes.
SHARED_ENV = "ROLLOUTFLEET_KIND_SHARED"


def cluster_config(cgroup_v1: bool, shared_dir: str, name: str = CLUSTER_NAME) -> str:
    """kind's cluster config: a control-plane node and a worker labelled and tainted as the GPU node
    (its nvidia.com/gpu capacity is patched into its status once it registers, as on the real-node
    cluster); no default CNI (kindnetd), kindnetd's pod subnet; `shared_dir` mounted in both. Pure."""
    patches = []
    if cgroup_v1:
        # kubelet 1.35 refuses cgroup v1 unless told otherwise (these machines have v1 only).
        patches.append("kind: KubeletConfiguration\nfailCgroupV1: false\n")
    gpu_join = yaml.safe_dump({"kind": "JoinConfiguration", "nodeRegistration": {"taints": [GPU_TAINT]}})
    shared = {"hostPath": shared_dir, "containerPath": shared_dir}
    # An explicit empty list: kubeadm then leaves off its control-plane taint.
    cpu_init = yaml.safe_dump({"kind": "InitConfiguration", "nodeRegistration": {"taints": []}})
    config = {
        "kind": "Cluster",
        "apiVersion": "kind.x-k8s.io/v1alpha4",
        "name": name,
        "networking": {"disableDefaultCNI": True, "podSubnet": POD_SUBNET},
        "kubeadmConfigPatches": patches,
        "nodes": [
            # Untainted: it is also the CPU node (operator, proxies, gateway), as rf-cpu-node is.
            {"role": "control-plane", "kubeadmConfigPatches": [cpu_init], "extraMounts": [shared]},
            {
                "role": "worker",
                "labels": {GPU_LABEL: "true"},
                "kubeadmConfigPatches": [gpu_join],
                "extraMounts": [shared],
            },
        ],
    }
    return yaml.safe_dump(config, sort_keys=False)


def cni_conflist(pod_cidr: str) -> str:
    """A node's CNI config from the plugins Debian ships in the node image: a point-to-point veth
    per pod with an address from the node's own pod CIDR (host-local), masquerading what leaves the
    node's CIDR, and host ports. Pure."""
    ipaddress.ip_network(pod_cidr)  # a bad CIDR fails here, not inside a pod sandbox
    conflist = {
        "cniVersion": "0.4.0",
        "name": "rolloutfleet-kind",
        "plugins": [
            {
                "type": "ptp",
                "ipMasq": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": pod_cidr}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }
    return json.dumps(conflist, indent=2) + "\n"


@dataclass(frozen=True)
class KindNode:
    name: str
    address: str  # on the Docker network
    pod_cidr: str


def pod_routes(nodes: list[KindNode]) -> dict[str, list[list[str]]]:
    """Node → the `ip route replace` arguments that reach every other node's pods through that
    node (what kindnetd does; the nodes share one Docker bridge, so one hop). Pure."""
    return {
        node.name: [
            ["ip", "route", "replace", other.pod_cidr, "via", other.address]
            for other in nodes
            if other != node
        ]
        for node in nodes
    }


def host_routes(nodes: list[KindNode]) -> list[list[str]]:
    """The routes that let this machine reach every node's pods (the e2e suite talks to pods by
    their IPs, as on the local cluster); they go with the kind network's bridge. Pure."""
    return [["ip", "route", "replace", node.pod_cidr, "via", node.address] for node in nodes]


def runtime_wrapper(runc: str = "/usr/sbin/runc") -> str:
    """A runc in front of runc that removes MISSING_CAPABILITY from a container's spec (--bundle's
    config.json) and from an exec'd process (--process) before runc applies them. Pure."""
    return f"""#!/bin/bash
# Docker's runtime here (dockerd --add-runtime): runc without {MISSING_CAPABILITY}, which this
# machine's root cannot grant.
bundle=""; process=""; prev=""
for a in "$@"; do
  case "$prev" in --bundle|-b) bundle="$a";; --process|-p) process="$a";; esac
  case "$a" in --bundle=*) bundle="${{a#--bundle=}}";; --process=*) process="${{a#--process=}}";; esac
  prev="$a"
done
strip='map_values(if type == "array" then map(select(. != "{MISSING_CAPABILITY}")) else . end)'
spec="$bundle/config.json"
if [ -n "$bundle" ] && [ -f "$spec" ]; then
  jq "if .process.capabilities then .process.capabilities |= $strip else . end" "$spec" > "$spec.tmp" \\
    && mv "$spec.tmp" "$spec"
fi
if [ -n "$process" ] && [ -f "$process" ]; then
  jq "if .capabilities then .capabilities |= $strip else . end" "$process" > "$process.tmp" \\
    && mv "$process.tmp" "$process"
fi
exec {runc} "$@"
"""


def image_names(kubeadm_list: str) -> dict[str, str]:
    """`kubeadm config images list` output → component → image (kube-apiserver, etcd, coredns,
    pause, ...), by the last path element's name. Pure."""
    images = {}
    for line in kubeadm_list.split():
        component = line.rsplit("/", 1)[-1].split(":", 1)[0]
        images[component] = line
    return images
