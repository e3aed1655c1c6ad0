"""What real SGLang needs (issue #12): engines that do not flap, logprobs that agree, endpoints."""

from __future__ import annotations

from typing import Any

from fleet_samples import ENGINE, GPU, container, flag, mutated, pod_spec
from rolloutfleet_operator import manifests
from rolloutfleet_operator.conditions import ObservedState, fleet_status
from rolloutfleet_operator.fleet import parse_fleet


def _env_of(manifest: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value") for e in container(manifest)["env"]}


def test_engines_do_not_flap_during_weight_updates_and_get_time_to_drain():
    env = _env_of(ENGINE)
    assert env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "0"  # /health cheap, not a generation
    assert "SGLANG_RETURN_ORIGINAL_LOGPROB" not in env
    probes = container(ENGINE)
    assert {probes[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe", "livenessProbe")} == {
        "/health"
    }
    startup = probes["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 3600  # weight loading
    assert pod_spec(ENGINE)["terminationGracePeriodSeconds"] == 600


def test_original_logprobs_reach_engines_and_proxies_alike():
    fleet = parse_fleet(mutated("proxy.engineLogprobs", "original"))
    assert _env_of(manifests.engine_deployment(fleet))["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1"
    assert _env_of(manifests.proxy_pod(fleet, 0))["ROLLOUTFLEET_PROXY_ENGINE_LOGPROBS"] == "original"
    assert _env_of(manifests.proxy_pod(GPU, 0))["ROLLOUTFLEET_PROXY_ENGINE_LOGPROBS"] == "tempered"
    assert manifests.template_hash(fleet) != manifests.template_hash(GPU)  # the proxies roll


def test_engines_get_a_headless_service_and_the_gateway_service_its_metrics_port():
    service = manifests.engine_service(GPU)
    assert service["metadata"]["name"] == "gpu-fleet-engines" and service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == manifests.labels(GPU, "engine")
    assert service in manifests.desired_children(GPU)
    ports = {p["name"]: p["port"] for p in manifests.gateway_service(GPU)["spec"]["ports"]}
    assert ports == {"http": 30080, "metrics": 29000}
    moved = parse_fleet(mutated("gateway.metricsPort", 29100))
    assert flag(container(manifests.gateway_deployment(moved))["args"], "--prometheus-port") == "29100"


def test_engine_endpoints_are_ready_live_engine_pods_or_the_external_urls():
    from rolloutfleet_operator.plan import ready_pod_urls

    def pod(name: str, ip: str | None, ready: bool, deleting: bool = False) -> dict[str, Any]:
        metadata: dict[str, Any] = {"name": name}
        if deleting:
            metadata["deletionTimestamp"] = "2026-11-22T00:00:00Z"
        status = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
        if ip:
            status["podIP"] = ip
        return {"metadata": metadata, "status": status}

    pods = [pod("e-b", "10.0.0.2", True), pod("e-a", "10.0.0.1", True), pod("e-c", "10.0.0.3", False)]
    pods += [pod("e-d", "10.0.0.4", True, deleting=True), pod("e-e", None, True)]
    assert ready_pod_urls(pods, 30000) == ["http://10.0.0.1:30000", "http://10.0.0.2:30000"]
    observed = ObservedState(1, (), "h", engine_endpoints=("http://10.0.0.1:30000",))
    assert fleet_status(GPU, observed, "now")["engineEndpoints"] == ["http://10.0.0.1:30000"]
