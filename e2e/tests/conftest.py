"""The cluster the e2e suite runs against.

Cluster-agnostic: with KUBECONFIG set, the tests use that cluster (e.g. kind, whose nodes must hold
the project's images; ROLLOUTFLEET_HOST_IP names the address its pods reach this machine at).
Otherwise they start a real local Kubernetes for the test session and stop it at the end: the
control plane and two real kubelets (`rf-cpu-node`, and `rf-gpu-node` with `nvidia.com/gpu` capacity,
label and taint) with containerd and runc, kube-proxy and CoreDNS (`rolloutfleet_testkit.node`), with
the project's images built locally from its Dockerfiles and imported into the nodes
(`rolloutfleet_testkit.images`).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from rolloutfleet_testkit.kubectl import Kubectl
from rolloutfleet_testkit.node.config import GPU_LABEL

# What the e2e tests run: the product's images and the test kit's (stand-ins and the real router).
IMAGES = ("proxy", "operator", "sglang-router", "testkit", "busybox")
GPU_IMAGES = ("sglang-emulator",)  # gigabytes (torch): only where engines run


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `kind` run on the kind cluster `./dev kind test` makes: deselected unless the
    run's -m expression names them (the default run has no Docker to make one). Tests marked
    `local_cluster` use the local cluster's internals: skipped, with their reason, on any other."""
    if os.environ.get("KUBECONFIG"):
        for item in items:
            marker = item.get_closest_marker("local_cluster")
            if marker is not None:
                item.add_marker(
                    pytest.mark.skip(reason=f"on the local cluster only: {marker.kwargs['reason']}")
                )
    if "kind" in (config.getoption("markexpr") or ""):
        return
    kept = [item for item in items if item.get_closest_marker("kind") is None]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept


@dataclass
class Cluster:
    kubeconfig: str
    local: bool
    bin_dir: Path | None  # where kubectl and helm are (local cluster), else from PATH
    host_ip: str  # an address of this machine the cluster's pods can reach (servers for pods bind it)
    audit_log: Path | None = None  # the API server's audit log (the local control plane writes one)
    node_root: Path | None = None  # the local cluster's state directory (its kubelets can be stopped)

    def tool(self, name: str) -> str:
        """kubectl or helm: the local cluster's build, else the one on PATH."""
        found = str(self.bin_dir / name) if self.bin_dir else shutil.which(name)
        if found is None:
            raise AssertionError(f"{name} is not on PATH (a cluster from KUBECONFIG uses the PATH's)")
        return found

    def kubectl_client(self) -> Kubectl:
        return Kubectl(self.tool("kubectl"), self.kubeconfig, timeout_s=300)

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None
    ) -> subprocess.CompletedProcess:
        result = self.kubectl_client().run(*args, input=input)
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({result.returncode}):\n{result.stderr}")
        return result

    def node_names(self, gpu: bool) -> set[str]:
        """The GPU-like nodes (labelled as the GPU Operator labels them) or the others: rf-gpu-node
        and rf-cpu-node on the local cluster, the worker and the control-plane node on kind."""
        selector = f"{GPU_LABEL}=true" if gpu else f"{GPU_LABEL}!=true"
        names = self.kubectl("get", "nodes", "-l", selector, "-o", "name").stdout.split()
        return {name.removeprefix("node/") for name in names}

    def logs(self, namespace: str, pod: str, container: str | None = None) -> str:
        """A container's log through the API server and the kubelet (`kubectl logs`); '' if none yet."""
        args = ["logs", pod, "-n", namespace, *(["-c", container] if container else [])]
        result = self.kubectl(*args, check=False)
        return result.stdout if result.returncode == 0 else ""


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    external = os.environ.get("KUBECONFIG")
    if external:
        yield Cluster(external, local=False, bin_dir=None, host_ip=os.environ.get("ROLLOUTFLEET_HOST_IP", ""))
        return
    from rolloutfleet_testkit.node import real_cluster
    from rolloutfleet_testkit.node.host import host_state

    with real_cluster(tmp_path_factory.mktemp("cluster"), images=IMAGES, gpu_images=GPU_IMAGES) as node:
        before = node.host_before  # after `up` cleared what a killed earlier run left
        from rolloutfleet_testkit.controlplane import audit

        audit_log = Path(node.kubeconfig).parent / audit.LOG_FILE
        yield Cluster(
            node.kubeconfig,
            local=True,
            bin_dir=node.bin_dir,
            host_ip=node.bridge_ip,
            audit_log=audit_log,
            node_root=node.root,
        )
    # Teardown put back every machine-wide setting the nodes changed (an error here fails the run).
    after = host_state()
    assert after == before, {k: (before[k], after[k]) for k in before if before[k] != after[k]}


@pytest.fixture(scope="session")
def kube(cluster: Cluster):
    from kubernetes import config

    return config.new_client_from_config(config_file=cluster.kubeconfig)


@pytest.fixture(scope="session", autouse=True)
def pods_read_the_test_tokenizer(test_tokenizer_dir: Path) -> None:
    """Pods mount the test tokenizer from this machine (hostPath) and run as non-root users: its
    directory and the ones above it (pytest's are private to root) must be readable by them."""
    from rolloutfleet_testkit.fleet_setup import pod_readable

    pod_readable(test_tokenizer_dir)


@pytest.fixture
def namespace(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace per test, deleted afterwards."""
    readable = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower())[:40].strip("-")
    # Parametrized tests share a prefix; a digest of the full id keeps their namespaces apart.
    name = f"t-{readable}-{hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:6]}"
    cluster.kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
