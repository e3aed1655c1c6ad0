"""The real SGLang router as a pod, discovering SGLang emulator pods (test stand-ins for SGLang)
through the Kubernetes API with its own service account's RBAC, and forgetting deleted ones."""

from __future__ import annotations

import json

import httpx
import pytest
from rolloutfleet_testkit import sample_workload as sample
from rolloutfleet_testkit.processes import wait_until_routed
from rolloutfleet_testkit.waiting import wait_for

pytestmark = pytest.mark.e2e


def worker_urls(router_url: str) -> set[str]:
    return {w["url"] for w in httpx.get(f"{router_url}/workers", timeout=5).json()["workers"]}


def test_router_discovers_engines_and_forgets_deleted_ones(cluster, namespace, test_tokenizer_dir):
    items = [
        *sample.router_rbac(namespace),
        sample.engines(namespace, 2, str(test_tokenizer_dir)),
        sample.router(namespace),
    ]
    cluster.kubectl(
        "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items})
    )
    cluster.kubectl("wait", "-n", namespace, "--for=condition=Ready", "pod", "--all", "--timeout=240s")
    pods = json.loads(cluster.kubectl("get", "pods", "-n", namespace, "-o", "json").stdout)["items"]
    engines = {
        p["metadata"]["name"]: p["status"]["podIP"]
        for p in pods
        if p["metadata"]["labels"].get("app.kubernetes.io/name") == "sample-engine"
    }
    assert len(engines) == 2
    assert {p["spec"]["nodeName"] for p in pods if p["metadata"]["name"] in engines} <= cluster.node_names(
        gpu=True
    )
    router_ip = next(p["status"]["podIP"] for p in pods if p["metadata"]["name"] == "sample-router")
    router_url = f"http://{router_ip}:{sample.ROUTER_PORT}"
    expected = {f"http://{ip}:{sample.ENGINE_PORT}" for ip in engines.values()}
    wait_for(
        lambda: worker_urls(router_url) == expected, what="the router to discover both engines", timeout_s=120
    )
    wait_until_routed(router_url)
    answer = httpx.post(
        f"{router_url}/generate",
        timeout=30,
        json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}, "return_logprob": True},
    )
    assert answer.status_code == 200 and len(answer.json()["output_ids"]) >= 1

    gone_name, gone_ip = next(iter(engines.items()))
    cluster.kubectl("delete", "pod", gone_name, "-n", namespace, "--wait=false")
    wait_for(
        lambda: f"http://{gone_ip}:{sample.ENGINE_PORT}" not in worker_urls(router_url),
        what="the deleted engine to leave the router's worker list",
        timeout_s=120,
    )
