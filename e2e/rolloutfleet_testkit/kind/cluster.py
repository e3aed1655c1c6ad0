"""`up` and `down` of the kind cluster: Docker started, the node image loaded, the cluster created,
its network made (our CNI config and routes on each node), the GPU node's capacity advertised, the
project's images loaded; and everything put back afterwards, checked against what was recorded
before Docker was installed."""

from __future__ import annotations

import functools
import json
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import BinaryIO

from rolloutfleet_testkit.controlplane.build import binaries_dir, ensure_go_tool, say
from rolloutfleet_testkit.node.config import GPU_COUNT, GPU_LABEL, GPU_RESOURCE

from . import docker, host
from .config import (
    CLUSTER_NAME,
    CNI_FILE,
    KIND_VERSION,
    SHARED_ENV,
    KindNode,
    cluster_config,
    cni_conflist,
    host_routes,
    pod_routes,
)

DEFAULT_IMAGES = ("proxy", "operator", "sglang-router", "testkit", "busybox")


def kubeconfig_path() -> Path:
    return docker.state_dir() / "kubeconfig"


def before_path() -> Path:
    return docker.state_dir() / "host-before.json"


def ensure_kind() -> Path:
    return ensure_go_tool("kind", "sigs.k8s.io/kind", KIND_VERSION)


def cgroup_v1() -> bool:
    return not Path("/sys/fs/cgroup/cgroup.controllers").exists()


def checked(*command: str, input: str | None = None, timeout: float = 600) -> str:
    result = subprocess.run(list(command), capture_output=True, text=True, input=input, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return result.stdout


def kubectl(*args: str, input: str | None = None) -> str:
    return checked(
        str(binaries_dir() / "kubectl"), "--kubeconfig", str(kubeconfig_path()), *args, input=input
    )


def timed(label: str, started: float) -> None:
    say(f"kind: {label} ({time.monotonic() - started:.0f}s)")


def kind_nodes() -> list[KindNode]:
    nodes = json.loads(kubectl("get", "nodes", "-o", "json"))["items"]
    return [
        KindNode(
            name=n["metadata"]["name"],
            address=next(a["address"] for a in n["status"]["addresses"] if a["type"] == "InternalIP"),
            pod_cidr=n["spec"]["podCIDR"],
        )
        for n in nodes
    ]


def wait_for_pod_cidrs(expected: int, timeout_s: float = 120) -> list[KindNode]:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            nodes = kind_nodes()
            if len(nodes) == expected:
                return nodes
        except (KeyError, StopIteration, RuntimeError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("the kind nodes did not get their pod CIDRs")
        time.sleep(1)


def make_network(nodes: list[KindNode]) -> None:
    """Our CNI config on each node (the kubelet then reports it Ready) and the routes between them."""
    routes = pod_routes(nodes)
    for node in nodes:
        checked(
            "docker",
            "exec",
            "-i",
            node.name,
            "sh",
            "-c",
            f"mkdir -p {Path(CNI_FILE).parent} && cat > {CNI_FILE}",
            input=cni_conflist(node.pod_cidr),
        )
        for route in routes[node.name]:
            checked("docker", "exec", node.name, *route)
    for route in host_routes(nodes):
        checked(*route)


def advertise_gpus() -> None:
    """nvidia.com/gpu capacity on the GPU node's status, as a device plugin's would appear."""
    patch = json.dumps({"status": {"capacity": {GPU_RESOURCE: str(GPU_COUNT)}}})
    for name in kubectl("get", "nodes", "-l", f"{GPU_LABEL}=true", "-o", "name").split():
        kubectl("patch", name, "--subresource=status", "--type=merge", "-p", patch)


def host_ip() -> str:
    """The kind network's gateway: this machine as the nodes' pods reach it."""
    return checked("docker", "network", "inspect", "kind", "-f", "{{(index .IPAM.Config 0).Gateway}}").strip()


# Where each image goes: where the pods that run it can be scheduled. The SGLang emulator only on
# the GPU node (its torch layers are gigabytes), as on the local cluster; the test kit's image (its
# stand-ins run as engines too) and busybox (the tests' plain pods, GPU ones included) everywhere;
# the product's images (proxies, operator, gateway: none tolerates the GPU taint) on the others.
GPU_IMAGES = ("sglang-emulator",)
EVERYWHERE = ("testkit", "busybox")
# What `kind load` runs on a node (kind's nodeutils), fed from a pipe: the archive is never written.
NODE_IMPORT = ("ctr", "--namespace=k8s.io", "images", "import", "--all-platforms", "--digests")


def nodes_for(image: str, gpu_nodes: Sequence[str], other_nodes: Sequence[str]) -> list[str]:
    """The nodes an image is loaded into (pure)."""
    if image in EVERYWHERE:
        return [*other_nodes, *gpu_nodes]
    return list(gpu_nodes if image in GPU_IMAGES else other_nodes)


def stream_into_node(node: str, write: Callable[[BinaryIO], None], timeout_s: float = 1800) -> None:
    # Its messages to a file, not a pipe: a pipe nobody reads while the archive is written could fill.
    with tempfile.TemporaryFile() as messages:
        importer = subprocess.Popen(
            ["docker", "exec", "-i", node, *NODE_IMPORT, "-"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=messages,
        )
        assert importer.stdin is not None
        try:
            with importer.stdin:
                write(importer.stdin)
        except BrokenPipeError:
            pass  # the importer ended early: its status and messages below say why
        if importer.wait(timeout=timeout_s) != 0:
            messages.seek(0)
            said = messages.read().decode(errors="replace")[-2000:]
            raise RuntimeError(f"importing into {node} failed ({importer.returncode}):\n{said}")


def load_images(names: Sequence[str]) -> None:
    from rolloutfleet_testkit.images.catalog import build_image
    from rolloutfleet_testkit.images.oci import normalized

    nodes = json.loads(kubectl("get", "nodes", "-o", "json"))["items"]
    gpu = [n["metadata"]["name"] for n in nodes if n["metadata"].get("labels", {}).get(GPU_LABEL) == "true"]
    others = [n["metadata"]["name"] for n in nodes if n["metadata"]["name"] not in gpu]
    for name in names:
        started = time.monotonic()
        built = build_image(name)
        for node in nodes_for(name, gpu, others):
            # Compressed: the nodes' containerd keeps the layers as they come, beside the unpacked
            # tree (the SGLang emulator's 5.7 GB would need 11.4 GB of disk, compressed 8).
            stream_into_node(node, functools.partial(built.stream, compressed=True))
            listed = checked("docker", "exec", node, *NODE_IMPORT[:2], "images", "ls", "-q")
            if normalized(built.names[0]) not in listed.split():
                raise RuntimeError(f"{node} does not list {built.names[0]} after its import said it did")
        timed(f"image {name} loaded", started)


def up(images: Sequence[str] = DEFAULT_IMAGES, timeout_s: float = 300) -> dict[str, str]:
    """The cluster up; returns the environment the e2e suite runs against it with."""
    from .nodeimage import NODE_IMAGE, node_image

    started = time.monotonic()
    if not before_path().exists():  # else an earlier `up` recorded the host before it changed it
        before_path().write_text(json.dumps(host.snapshot()))
    kind = ensure_kind()
    archive = node_image()
    timed("node image ready", started)
    docker.install()
    docker.start()
    timed("Docker running", started)
    checked("docker", "load", "-i", str(archive), timeout=1800)
    timed("node image loaded into Docker", started)
    config = docker.state_dir() / "kind-config.yaml"
    shared = docker.state_dir() / "shared"
    shared.mkdir(exist_ok=True)
    config.write_text(cluster_config(cgroup_v1(), str(shared)))
    checked(
        str(kind), "create", "cluster", "--name", CLUSTER_NAME, "--image", NODE_IMAGE,
        "--config", str(config), "--kubeconfig", str(kubeconfig_path()), "--retain",
    )  # fmt: skip
    timed("kind create cluster", started)
    make_network(wait_for_pod_cidrs(expected=2))
    kubectl("wait", "--for=condition=Ready", "nodes", "--all", f"--timeout={int(timeout_s)}s")
    advertise_gpus()
    timed("nodes Ready", started)
    load_images(images)
    kubectl("-n", "kube-system", "rollout", "status", "deployment/coredns", f"--timeout={int(timeout_s)}s")
    timed("cluster up", started)
    return {"KUBECONFIG": str(kubeconfig_path()), "ROLLOUTFLEET_HOST_IP": host_ip(), SHARED_ENV: str(shared)}


def down() -> None:
    """The cluster, Docker and its packages gone, and every host setting put back; raises if any
    setting still differs from what `up` recorded."""
    started = time.monotonic()
    if docker.state_dir().joinpath("dockerd.pid").exists():
        kind = ensure_kind()
        subprocess.run([str(kind), "delete", "cluster", "--name", CLUSTER_NAME], capture_output=True)
    docker.stop()
    kubeconfig_path().unlink(missing_ok=True)
    if not before_path().exists():
        say("kind: no recorded host state (nothing was up)")
        return
    left = host.restore(json.loads(before_path().read_text()))
    if left:
        raise RuntimeError(f"the host differs from before `up`: {left}")
    before_path().unlink()
    timed("down, host as before", started)


def environment_lines(env: dict[str, str]) -> str:
    return "".join(f"export {key}={value}\n" for key, value in env.items())
