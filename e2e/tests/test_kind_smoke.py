"""The kind smoke (issue 29): on a kind cluster made by `./dev kind test` (marker `kind`, not in the
default pytest run), the CRD and the operator installed with Helm, the GPU sample fleet (adapted as
on the local cluster: its volumes in the directory the kind nodes share with this machine) Ready
with its engines on the GPU-like worker, a session's turn through a proxy, and that proxy deleted
and restored under its name with the session, token for token.

Its engines are one of two test stand-ins for SGLang: `fixed-latency` (the test kit's image, no
model: what CI runs, `./dev test` ends with it) or `emulator` (the SGLang emulator: a tiny torch
model, whose image costs the GPU node 8.4 GB of disk; `./dev kind test --engine emulator`)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from fleet_watch import all_replaced_and_available, proxy_pods
from operator_install import installed_operator
from rolloutfleet_testkit import fleet_setup
from rolloutfleet_testkit.kind.config import SHARED_ENV
from rolloutfleet_testkit.waiting import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.kind]

FLEET = "gpu"
READY_S = 600  # the emulator (torch) starts slowly on a loaded 2-core machine


def status(cluster, namespace: str, name: str = FLEET) -> dict:
    fleet = json.loads(cluster.kubectl("get", "rf", name, "-n", namespace, "-o", "json").stdout)
    return fleet.get("status", {})


@pytest.mark.parametrize("engine", ["fixed-latency", "emulator"])
def test_gpu_sample_fleet_on_kind_restores_a_deleted_proxy(cluster, test_tokenizer_dir, engine):
    shared = os.environ.get(SHARED_ENV)
    assert shared, (
        f"runs on the cluster `./dev kind test` makes ({SHARED_ENV} names the nodes' shared directory)"
    )
    tokenizer = Path(shared) / "tokenizer"
    shutil.rmtree(tokenizer, ignore_errors=True)
    shutil.copytree(test_tokenizer_dir, tokenizer)
    fleet_setup.pod_readable(tokenizer)
    namespace = f"kind-smoke-{engine}"
    dumps = fleet_setup.pod_writable(Path(shared) / namespace)
    with installed_operator(cluster, namespace, "smoke"):
        fleet = fleet_setup.local_fleet(
            FLEET, namespace, tokenizer, dumps, fixed_latency_engines=engine == "fixed-latency"
        )
        replicas = fleet["spec"]["proxy"]["replicas"]
        cluster.kubectl("apply", "-f", "-", input=json.dumps(fleet))
        wait_for(
            lambda: fleet_setup.fleet_ready(status(cluster, namespace), replicas),
            timeout_s=READY_S,
            what="the GPU sample fleet Ready",
            interval_s=2,
            detail=lambda: cluster.kubectl("get", "pods", "-n", namespace, "-o", "wide", check=False).stdout,
        )
        engines = component_pods(cluster, namespace, FLEET, "engine")["items"]
        gpu_nodes = cluster.node_names(gpu=True)
        assert engines and all(pod["spec"]["nodeName"] in gpu_nodes for pod in engines)
        assert {c["image"] for pod in engines for c in pod["spec"]["containers"]} == {
            fleet["spec"]["engines"]["image"]
        }

        a_deleted_proxy_comes_back_with_its_session(cluster, namespace, FLEET, replicas)
        cluster.kubectl("delete", "rf", FLEET, "-n", namespace)


def component_pods(cluster, namespace: str, fleet: str, component: str) -> dict:
    """The listing (`kubectl get pods -o json`) of one of the fleet's components' pods."""
    selector = fleet_setup.component_selector(fleet, component)
    return json.loads(cluster.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "json").stdout)


def a_deleted_proxy_comes_back_with_its_session(cluster, namespace: str, fleet: str, replicas: int) -> None:
    """A session's turn through the fleet's first proxy; that proxy deleted; its replacement (same
    name) Ready with the fleet, holding the session token for token."""
    pods = component_pods(cluster, namespace, fleet, "proxy")
    name, url = sorted(fleet_setup.pod_urls(pods, fleet_setup.PROXY_PORT).items())[0]
    secret = json.loads(
        cluster.kubectl("get", "secret", f"{fleet}-admin-key", "-n", namespace, "-o", "json").stdout
    )
    key = fleet_setup.admin_key(secret)
    session_id, _ = fleet_setup.create_session(url, key)
    fleet_setup.one_turn(url, session_id, key, [{"role": "user", "content": "Hello from kind"}])
    recorded = fleet_setup.session_tokens(url, session_id, key)

    before = {name: proxy_pods(cluster, namespace, fleet)[name]["metadata"]["uid"]}
    cluster.kubectl("delete", "pod", name, "-n", namespace)
    wait_for(
        lambda: all_replaced_and_available(proxy_pods(cluster, namespace, fleet), before),
        timeout_s=300,
        what=f"{name} replaced",
        interval_s=1,
    )
    wait_for(
        lambda: fleet_setup.fleet_ready(status(cluster, namespace, fleet), replicas),
        timeout_s=300,
        what="Ready again",
    )
    pods = component_pods(cluster, namespace, fleet, "proxy")
    restored = fleet_setup.session_tokens(
        fleet_setup.pod_urls(pods, fleet_setup.PROXY_PORT)[name], session_id, key
    )
    assert restored == recorded
