"""The operator, as a process, against the local cluster and the process kubelet: a RolloutFleet
becomes proxies and a gateway, status follows Kubernetes conventions, scale works both ways
(highest ordinals go first), a deleted proxy pod comes back under its name, and deleting the fleet
garbage-collects everything. Engines are external here: a CPU reference engine (test stand-in for
SGLang) served on 127.0.0.1, which the gateway pod reaches directly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rolloutfleet_testkit.processes import ServerProcess, python_module, serve_app
from rolloutfleet_testkit.refengine.server import create_app as create_engine_app
from waiting import wait_for

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def operator(cluster, tmp_path_factory):
    if cluster.kubelet is None:
        pytest.skip("runs pods through the process kubelet")
    cluster.kubectl("apply", "-f", str(ROOT / "crds"))
    cluster.kubectl(
        "wait", "--for=condition=Established", "crd/rolloutfleets.rolloutfleet.dev", "--timeout=60s"
    )
    namespace = "operator-e2e"
    cluster.kubectl("create", "namespace", namespace)
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    process = ServerProcess(
        python_module("rolloutfleet_operator", "--namespace", namespace, "--metrics-port", "0"),
        log,
        env={"KUBECONFIG": cluster.kubeconfig},
    )
    try:
        yield namespace, process
    finally:
        process.terminate()
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def get(cluster, namespace: str, *what: str) -> dict:
    return json.loads(cluster.kubectl("get", *what, "-n", namespace, "-o", "json").stdout)


def proxy_pods(cluster, namespace: str) -> list[str]:
    items = get(cluster, namespace, "pods", "-l", "app.kubernetes.io/component=proxy")["items"]
    return sorted(p["metadata"]["name"] for p in items if not p["metadata"].get("deletionTimestamp"))


def pod_uid(cluster, namespace: str, name: str) -> str | None:
    result = cluster.kubectl("get", "pod", name, "-n", namespace, "-o", "json", check=False)
    return json.loads(result.stdout)["metadata"]["uid"] if result.returncode == 0 else None


def condition(status: dict, kind: str) -> str | None:
    return next((c["status"] for c in status.get("conditions", []) if c["type"] == kind), None)


def test_fleet_lifecycle(cluster, operator, test_tokenizer_dir):
    namespace, process = operator
    with serve_app(create_engine_app(str(test_tokenizer_dir), seed=0)) as engine_url:
        fleet = {
            "apiVersion": "rolloutfleet.dev/v1alpha1",
            "kind": "RolloutFleet",
            "metadata": {"name": "f1", "namespace": namespace},
            "spec": {
                "proxy": {
                    "replicas": 2,
                    "tokenizer": {
                        "path": "/models/tokenizer",
                        "volume": {"hostPath": {"path": str(test_tokenizer_dir)}},
                    },
                },
                "gateway": {"policy": "round_robin"},
                "externalEngineUrls": [engine_url],
            },
        }
        cluster.kubectl("apply", "-f", "-", input=json.dumps(fleet))

        def ready(replicas: int):
            status = get(cluster, namespace, "rf", "f1").get("status", {})
            ok = status.get("readyReplicas") == replicas and condition(status, "Ready") == "True"
            return ok and status

        status = wait_for(
            lambda: ready(2), timeout_s=120, what="the fleet to be Ready with 2 proxies", interval_s=1
        )
        assert status["observedGeneration"] == 1 and condition(status, "GatewayReady") == "True"
        assert status["selector"] and len(status["proxyEndpoints"]) == 2
        assert proxy_pods(cluster, namespace) == ["f1-proxy-0", "f1-proxy-1"]
        for kind in ("pods", "deployments", "services"):
            for item in get(cluster, namespace, kind)["items"]:
                owners = item["metadata"].get("ownerReferences", [])
                if kind != "pods" or item["metadata"]["name"].startswith("f1-proxy"):
                    assert any(o["kind"] in ("RolloutFleet", "ReplicaSet") for o in owners), item["metadata"][
                        "name"
                    ]

        cluster.kubectl("scale", "rf/f1", "-n", namespace, "--replicas=3")
        wait_for(lambda: ready(3), timeout_s=120, what="scale up to 3", interval_s=1)
        cluster.kubectl("scale", "rf/f1", "-n", namespace, "--replicas=1")
        wait_for(
            lambda: proxy_pods(cluster, namespace) == ["f1-proxy-0"],
            timeout_s=120,
            what="scale down removing the highest ordinals",
            interval_s=1,
        )

        uid = get(cluster, namespace, "pod", "f1-proxy-0")["metadata"]["uid"]
        cluster.kubectl("delete", "pod", "f1-proxy-0", "-n", namespace, "--wait=false")
        wait_for(
            lambda: pod_uid(cluster, namespace, "f1-proxy-0") not in (None, uid) and ready(1),
            timeout_s=120,
            what="the deleted proxy to come back under its name",
            interval_s=1,
        )

        cluster.kubectl("delete", "rf", "f1", "-n", namespace)
        wait_for(
            lambda: (
                not get(cluster, namespace, "pods")["items"]
                and not get(cluster, namespace, "deployments")["items"]
            ),
            timeout_s=120,
            what="garbage collection of the fleet's children",
            interval_s=1,
        )
    assert process.process.poll() is None, process.log_tail()
