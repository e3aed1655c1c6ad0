"""What the node's parts are configured with: pure functions of names, addresses and directories.

The layout: one Linux bridge (BRIDGE, BRIDGE_IP) inside this machine holds every pod's address; each
node (a kubelet with its own containerd) hands out addresses from its own slice of the bridge's
subnet, so two nodes on one host never collide; the API server listens on the bridge address, which
is also every node's InternalIP; kube-proxy (one for the host: iptables are host-global) and CoreDNS
make Service addresses and names work as on any cluster.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BRIDGE = "rfbr0"
BRIDGE_IP = "10.88.0.1"
POD_SUBNET = "10.88.0.0/16"
SERVICE_CIDR = "10.0.0.0/24"  # the control plane's --service-cluster-ip-range
CLUSTER_DNS_IP = "10.0.0.10"
CLUSTER_DOMAIN = "cluster.local"
PAUSE_IMAGE = "rolloutfleet.local/pause:1"
COREDNS_IMAGE = "rolloutfleet.local/coredns:1.14.7"
GPU_RESOURCE = "nvidia.com/gpu"
GPU_LABEL = "nvidia.com/gpu.present"
GPU_COUNT = 8


@dataclass(frozen=True)
class NodeSpec:
    """One node: its name, the third octet of its pod address slice, and whether it is the GPU node."""

    name: str
    slice: int
    gpu: bool = False

    @property
    def range_start(self) -> str:
        return f"10.88.{self.slice}.2"

    @property
    def range_end(self) -> str:
        return f"10.88.{self.slice}.254"


NODES = (NodeSpec("rf-cpu-node", 1), NodeSpec("rf-gpu-node", 2, gpu=True))


@dataclass(frozen=True)
class NodeDirs:
    """Where one node keeps its state: under the cluster's directory, except containerd's image
    store (`store`), which outlives a cluster so an image is imported once per build (gigabytes)."""

    root: Path
    store: Path

    @property
    def containerd(self) -> Path:
        return self.root / "containerd"

    @property
    def socket(self) -> Path:
        return self.containerd / "containerd.sock"

    @property
    def cni_conf(self) -> Path:
        return self.root / "cni"

    @property
    def ipam(self) -> Path:
        return self.root / "ipam"

    @property
    def kubelet(self) -> Path:
        return self.root / "kubelet"

    @property
    def pod_logs(self) -> Path:
        return self.root / "pod-logs"


def cgroup_root(node: NodeSpec) -> str:
    return f"/rolloutfleet-{node.name}"


def cni_conflist(node: NodeSpec, dirs: NodeDirs) -> dict[str, Any]:
    """The bridge network every pod joins; masquerading is off (nothing leaves this machine)."""
    return {
        "cniVersion": "1.0.0",
        "name": "rolloutfleet",
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": True,
                "ipMasq": False,
                # A pod reaching a Service that lands on itself goes out and back through the bridge.
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [
                        [
                            {
                                "subnet": POD_SUBNET,
                                "rangeStart": node.range_start,
                                "rangeEnd": node.range_end,
                                "gateway": BRIDGE_IP,
                            }
                        ]
                    ],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(dirs.ipam),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def containerd_config(dirs: NodeDirs) -> str:
    """containerd 1.6 (Debian's) for one node: its own root, state and sockets."""
    base = dirs.containerd
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return f"""version = 2
root = "{dirs.store}"
state = "{base / "state"}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "{dirs.socket}"

[ttrpc]
  address = "{base / "containerd.sock.ttrpc"}"

[debug]
  address = "{base / "debug.sock"}"

[plugins."io.containerd.internal.v1.opt"]
  path = "{base / "opt"}"

[{cri}]
  sandbox_image = "{PAUSE_IMAGE}"
  # Root here lacks CAP_SYS_RESOURCE: lowering a process's OOM score adjustment fails, and every
  # sandbox with it ("can't get final child's PID from pipe").
  restrict_oom_score_adj = true
  disable_apparmor = true
  enable_selinux = false
  max_container_log_line_size = 16384

[{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"

[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[{cri}.containerd.runtimes.runc.options]
  SystemdCgroup = false

[{cri}.cni]
  bin_dir = "/usr/lib/cni"
  conf_dir = "{dirs.cni_conf}"
"""


def kubelet_config(
    node: NodeSpec,
    dirs: NodeDirs,
    port: int,
    healthz_port: int,
    ca_file: Path,
    serving: tuple[Path, Path] | None = None,
) -> dict:
    """KubeletConfiguration (v1beta1) for one node; `serving` is its (certificate, key) for its API
    (without, the kubelet makes itself a self-signed one that nobody can verify)."""
    tls = {"tlsCertFile": str(serving[0]), "tlsPrivateKeyFile": str(serving[1])} if serving else {}
    return {
        **tls,
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        # This machine's kernel has cgroup v1 hierarchies; 1.35 refuses them unless told.
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": cgroup_root(node),
        "address": BRIDGE_IP,
        "port": port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz_port,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": False},
            "x509": {"clientCAFile": str(ca_file)},
        },
        # Only clients with a certificate of the cluster's CA get in (the API server among them).
        "authorization": {"mode": "AlwaysAllow"},
        "clusterDNS": [CLUSTER_DNS_IP],
        "clusterDomain": CLUSTER_DOMAIN,
        "resolvConf": str(dirs.root / "resolv.conf"),
        "containerRuntimeEndpoint": f"unix://{dirs.socket}",
        "podLogsDir": str(dirs.pod_logs),
        "failSwapOn": False,
        "protectKernelDefaults": False,
        "serializeImagePulls": False,
        # Shared disks of a development machine: never evict pods or delete images for disk space.
        # A disk threshold, once crossed, makes the eviction manager delete every unused image
        # (v1.35 pkg/kubelet/eviction/helpers.go: imagefs/nodefs reclaim = DeleteUnusedImages), the
        # sandbox's pause image among them between pods; "0%" is how a threshold is turned off
        # (parseThresholdStatement ignores 0% and 100%). Image GC itself is off below: high 100%.
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "0%",
            "imagefs.available": "0%",
            "nodefs.inodesFree": "0%",
            "imagefs.inodesFree": "0%",
        },
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "maxPods": 110,
        "nodeStatusUpdateFrequency": "5s",
        "syncFrequency": "10s",
        "fileCheckFrequency": "5s",
        "staticPodPath": str(dirs.root / "manifests"),
    }


def kubelet_args(node: NodeSpec, dirs: NodeDirs, kubelet_bin: Path, kubeconfig: Path) -> list[str]:
    args = [
        str(kubelet_bin),
        f"--config={dirs.root / 'kubelet-config.json'}",
        f"--kubeconfig={kubeconfig}",
        f"--hostname-override={node.name}",
        f"--node-ip={BRIDGE_IP}",
        f"--root-dir={dirs.kubelet}",
        f"--cert-dir={dirs.root / 'kubelet-pki'}",
        "--v=1",
    ]
    if node.gpu:
        args += [
            f"--node-labels={GPU_LABEL}=true",
            f"--register-with-taints={GPU_RESOURCE}=present:NoSchedule",
        ]
    return args


def kube_proxy_config(kubeconfig: Path, hostname: str, healthz_port: int, metrics_port: int) -> dict:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "mode": "iptables",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "hostnameOverride": hostname,
        "clusterCIDR": POD_SUBNET,
        "bindAddress": "127.0.0.1",
        "healthzBindAddress": f"127.0.0.1:{healthz_port}",
        "metricsBindAddress": f"127.0.0.1:{metrics_port}",
        # NodePorts only on the bridge (never on this machine's uplink or loopback).
        "nodePortAddresses": [f"{BRIDGE_IP}/32"],
        "iptables": {"localhostNodePorts": False, "syncPeriod": "10s", "minSyncPeriod": "0s"},
        # Leave the host's conntrack table size alone (a sysctl write it may not be allowed).
        "conntrack": {"maxPerCore": 0},
    }


def corefile(health_port: int, ready_port: int) -> str:
    """CoreDNS for the cluster's names only (no forwarding: nothing outside this machine is reached)."""
    return f"""cluster.local:53 in-addr.arpa:53 {{
    bind {BRIDGE_IP}
    errors
    health {BRIDGE_IP}:{health_port}
    ready {BRIDGE_IP}:{ready_port}
    kubernetes cluster.local in-addr.arpa {{
        pods insecure
        fallthrough in-addr.arpa
    }}
    cache 5
    loadbalance
    reload
}}
.:53 {{
    bind {BRIDGE_IP}
    errors
}}
"""


def dns_objects(health_port: int, ready_port: int) -> list[dict[str, Any]]:
    """CoreDNS as a host-network Deployment on the CPU node, its RBAC and the kube-dns Service."""
    namespace = "kube-system"
    labels = {"k8s-app": "kube-dns"}
    meta = {"name": "coredns", "namespace": namespace}
    container = {
        "name": "coredns",
        "image": COREDNS_IMAGE,
        "imagePullPolicy": "IfNotPresent",
        "args": ["-conf", "/etc/coredns/Corefile"],
        "volumeMounts": [{"name": "config", "mountPath": "/etc/coredns", "readOnly": True}],
        "readinessProbe": {"httpGet": {"path": "/ready", "port": ready_port}, "periodSeconds": 1},
        "livenessProbe": {"httpGet": {"path": "/health", "port": health_port}, "periodSeconds": 10},
    }
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": "rolloutfleet:coredns"},
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["services", "pods", "namespaces"],
                    "verbs": ["list", "watch"],
                },
                {
                    "apiGroups": ["discovery.k8s.io"],
                    "resources": ["endpointslices"],
                    "verbs": ["list", "watch"],
                },
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "rolloutfleet:coredns"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "rolloutfleet:coredns",
            },
            "subjects": [{"kind": "ServiceAccount", "name": "coredns", "namespace": namespace}],
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": meta,
            "data": {"Corefile": corefile(health_port, ready_port)},
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {**meta, "labels": labels},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "serviceAccountName": "coredns",
                        "hostNetwork": True,
                        "dnsPolicy": "Default",
                        "priorityClassName": "system-cluster-critical",
                        "nodeSelector": {"kubernetes.io/hostname": NODES[0].name},
                        "containers": [container],
                        "volumes": [{"name": "config", "configMap": {"name": "coredns"}}],
                    },
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "kube-dns", "namespace": namespace, "labels": labels},
            "spec": {
                "clusterIP": CLUSTER_DNS_IP,
                "selector": labels,
                "ports": [
                    {"name": "dns", "port": 53, "protocol": "UDP"},
                    {"name": "dns-tcp", "port": 53, "protocol": "TCP"},
                ],
            },
        },
    ]


def node_access_objects() -> list[dict[str, Any]]:
    """Without the Node authorizer, kubelets get the system:node role through RBAC."""
    return [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "rolloutfleet:nodes"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "system:node",
            },
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "system:nodes"}],
        }
    ]


def as_list(items: list[dict[str, Any]]) -> str:
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": items})
