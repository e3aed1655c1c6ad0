"""The cluster the e2e suite runs against.

Cluster-agnostic: with KUBECONFIG set, the tests use that cluster (e.g. kind); otherwise they start
the local control plane (binaries built from the Go module proxy on first use, then cached) for
the test session and stop it at the end, with the process kubelet (a test harness, in this
process) registering rf-cpu-node and rf-gpu-node and running scheduled pods as local processes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from rolloutfleet_testkit.kubectl import Kubectl


@dataclass
class Cluster:
    kubeconfig: str
    kubelet: Any | None  # the in-process ProcessKubelet, None on an external cluster
    local: bool
    bin_dir: Path | None  # where kubectl and helm are (local control plane), else from PATH

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None
    ) -> subprocess.CompletedProcess:
        binary = str(self.bin_dir / "kubectl") if self.bin_dir else shutil.which("kubectl")
        result = Kubectl(binary, self.kubeconfig, timeout_s=60).run(*args, input=input)
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({result.returncode}):\n{result.stderr}")
        return result


@contextlib.contextmanager
def process_kubelet(kubeconfig: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The process kubelet (test harness) in this process: rf-cpu-node and rf-gpu-node run pods."""
    from rolloutfleet_testkit.kubelet import ProcessKubelet

    kubelet = ProcessKubelet(kubeconfig, tmp_path_factory.mktemp("kubelet")).start()
    try:
        yield kubelet
    finally:
        kubelet.stop()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    external = os.environ.get("KUBECONFIG")
    if external:
        # An external cluster has its own kubelets; ROLLOUTFLEET_PROCESS_KUBELET=1 adds the process
        # kubelet's nodes anyway (e.g. for a control plane started with `controlplane up`).
        if os.environ.get("ROLLOUTFLEET_PROCESS_KUBELET") == "1":
            with process_kubelet(external, tmp_path_factory) as kubelet:
                yield Cluster(external, kubelet, local=False, bin_dir=None)
        else:
            yield Cluster(external, None, local=False, bin_dir=None)
        return
    from rolloutfleet_testkit.controlplane.build import ensure_binaries
    from rolloutfleet_testkit.controlplane.cluster import down, up

    bin_dir = ensure_binaries()
    root = tmp_path_factory.mktemp("cluster")
    state = up(root)
    try:
        with process_kubelet(state.kubeconfig, tmp_path_factory) as kubelet:
            yield Cluster(state.kubeconfig, kubelet, local=True, bin_dir=bin_dir)
    finally:
        down(root)


@pytest.fixture(scope="session")
def kube(cluster: Cluster):
    from kubernetes import config

    return config.new_client_from_config(config_file=cluster.kubeconfig)


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
