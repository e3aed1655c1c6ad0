"""The SGLang engines (manifests/engines.py): what the spec says reaches the engine Deployment; GPUs,
shared memory, probes that survive weight updates, logprobs that agree with the proxies' records."""

from __future__ import annotations

from typing import Any

import pytest
from fleet_samples import (
    ENGINE,
    GPU,
    container,
    flag,
    fleet_with,
    mutated,
    pod_spec,
    pod_template,
    sample,
    volume,
)
from rolloutfleet_operator.fleet import labels, parse_fleet
from rolloutfleet_operator.manifests.children import desired_children
from rolloutfleet_operator.manifests.engines import (
    ENGINE_CONTAINER_DEFAULT,
    HEALTH_GENERATION_ENV,
    SHM_VOLUME,
    engine_deployment,
    engine_service,
)
from rolloutfleet_operator.manifests.proxy_pod import proxy_pod, template_hash

GPU_ROWS = [
    ("engine replicas", ENGINE["spec"]["replicas"], 2),
    ("engine image", container(ENGINE)["image"], "lmsysorg/sglang:latest"),
    ("engine command", container(ENGINE)["command"], ["python3", "-m", "sglang.launch_server"]),
    (
        "engine args",
        container(ENGINE)["args"],
        [
            "--model-path",
            "/models",
            "--host",
            "0.0.0.0",
            "--port",
            "30000",
            "--tp-size",
            "2",
            "--mem-fraction-static",
            "0.85",
        ],
    ),
    ("engine binds the wildcard", flag(container(ENGINE)["args"], "--host"), "0.0.0.0"),
    (
        "engine resources + gpus",
        container(ENGINE)["resources"],
        {"requests": {"cpu": "8", "memory": "64Gi"}, "limits": {"nvidia.com/gpu": "2"}},
    ),
    ("engine node selector", pod_spec(ENGINE)["nodeSelector"], {"nvidia.com/gpu.present": "true"}),
    (
        "engine tolerations",
        pod_spec(ENGINE)["tolerations"],
        [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    ),
    (
        "engine model volume",
        volume(ENGINE, "/models"),
        {
            "mount": {"name": "model", "mountPath": "/models", "readOnly": True},
            "volume": {
                "name": "model",
                "persistentVolumeClaim": {"claimName": "model-weights", "readOnly": True},
            },
        },
    ),
    (
        "engine shm",
        volume(ENGINE, "/dev/shm")["volume"]["emptyDir"],
        {"medium": "Memory", "sizeLimit": "16Gi"},
    ),
    ("engine readiness", container(ENGINE)["readinessProbe"]["httpGet"], {"path": "/health", "port": 30000}),
    ("engine pod labels", ENGINE["spec"]["template"]["metadata"]["labels"], labels(GPU, "engine")),
    ("engine selector", ENGINE["spec"]["selector"]["matchLabels"], labels(GPU, "engine")),
]


@pytest.mark.parametrize(("what", "actual", "expected"), GPU_ROWS, ids=[row[0] for row in GPU_ROWS])
def test_gpu_sample_reaches_the_engines(what, actual, expected):
    assert actual == expected, what


@pytest.mark.parametrize("gpus", [0, 1, 4])
def test_gpu_limit_follows_gpus_per_engine(gpus):
    obj = sample("gpu")
    obj["spec"]["engines"]["gpusPerEngine"] = gpus
    obj["spec"]["engines"]["tensorParallelSize"] = 1
    limits = container(engine_deployment(parse_fleet(obj)))["resources"].get("limits", {})
    assert limits.get("nvidia.com/gpu") == (str(gpus) if gpus else None)


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


def test_routing_replay_turns_on_the_engines_capture_once():
    def args_of(obj: dict[str, Any]) -> list[str]:
        return container(engine_deployment(parse_fleet(obj)))["args"]

    assert "--enable-return-routed-experts" not in args_of(sample("gpu"))
    on = mutated("proxy.routedExperts", True)
    assert args_of(on).count("--enable-return-routed-experts") == 1
    on["spec"]["engines"]["args"] = ["--enable-return-routed-experts", "--mem-fraction-static", "0.8"]
    assert args_of(on).count("--enable-return-routed-experts") == 1  # the user's own, not doubled


def test_original_logprobs_reach_engines_and_proxies_alike():
    fleet = parse_fleet(mutated("proxy.engineLogprobs", "original"))
    assert _env_of(engine_deployment(fleet))["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1"
    assert _env_of(proxy_pod(fleet, 0))["ROLLOUTFLEET_PROXY_ENGINE_LOGPROBS"] == "original"
    assert _env_of(proxy_pod(GPU, 0))["ROLLOUTFLEET_PROXY_ENGINE_LOGPROBS"] == "tempered"
    assert template_hash(fleet) != template_hash(GPU)  # the proxies roll


def test_engines_get_a_headless_service():
    service = engine_service(GPU)
    assert service["metadata"]["name"] == "gpu-fleet-engines" and service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == labels(GPU, "engine")
    assert service in desired_children(GPU)


def test_engines_take_env_runtime_class_shm_size_and_security_context():
    secret_env = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    override = {"name": HEALTH_GENERATION_ENV, "value": "1"}
    fleet = fleet_with(
        "engines",
        env=[secret_env, override],
        envFrom=[{"configMapRef": {"name": "nccl"}}],
        runtimeClassName="nvidia",
        serviceAccountName="weights-reader",
        shmSize="16Gi",
        podSecurityContext={"fsGroup": 1000},
    )
    _, spec = pod_template(engine_deployment(fleet))
    (engine,) = spec["containers"]
    assert [e for e in engine["env"] if e["name"] == HEALTH_GENERATION_ENV] == [override]
    assert secret_env in engine["env"] and engine["envFrom"] == [{"configMapRef": {"name": "nccl"}}]
    assert spec["runtimeClassName"] == "nvidia" and spec["serviceAccountName"] == "weights-reader"
    assert spec["securityContext"] == {"fsGroup": 1000}
    shm = next(v for v in spec["volumes"] if v["name"] == SHM_VOLUME)
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert engine["securityContext"] == ENGINE_CONTAINER_DEFAULT
    _, spec = pod_template(engine_deployment(fleet_with("engines", securityContext={"privileged": True})))
    assert spec["containers"][0]["securityContext"] == {"privileged": True}
