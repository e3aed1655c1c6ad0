"""The operator's pure parts: the fleet view, the manifests, the proxy plan, conditions and status."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from rolloutfleet_operator import manifests
from rolloutfleet_operator.conditions import (
    CRASHLOOP_RESTARTS,
    Condition,
    ObservedState,
    fleet_conditions,
    fleet_status,
    set_condition,
)
from rolloutfleet_operator.fleet import (
    DEFAULTS,
    TEMPLATE_HASH_ANNOTATION,
    OperatorDefaults,
    client_service_name,
    engine_name,
    gateway_name,
    headless_service_name,
    labels,
    operator_defaults,
    parse_fleet,
    proxy_ordinal,
    proxy_pod_name,
    selector_string,
)
from rolloutfleet_operator.plan import Deletion, ProxyPodView, plan_proxies, proxy_pod_view
from rolloutfleet_proxy.reasoning_parsers import REASONING_PARSER_NAMES
from rolloutfleet_proxy.settings import ENV, ProxySettings, effective_settings, load_settings
from rolloutfleet_proxy.tool_parsers import TOOL_CALL_PARSER_NAMES

ROOT = Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "crds" / "rolloutfleets.rolloutfleet.dev.yaml").read_text())
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
SAMPLES = ROOT / "operator" / "samples"
NOW = "2026-01-01T00:00:00Z"
LATER = "2026-01-01T00:05:00Z"


def sample(name: str, namespace: str = "rl", uid: str = "uid-1", generation: int = 3) -> dict[str, Any]:
    obj = yaml.safe_load((SAMPLES / f"{name}.yaml").read_text())
    obj["metadata"].update({"namespace": namespace, "uid": uid, "generation": generation})
    return obj


GPU = parse_fleet(sample("gpu"))
MINIMAL = parse_fleet(sample("minimal"))


def container(manifest: dict[str, Any]) -> dict[str, Any]:
    spec = manifest["spec"]
    pod_spec = spec["template"]["spec"] if "template" in spec else spec
    (only,) = pod_spec["containers"]
    return only


def pod_spec(manifest: dict[str, Any]) -> dict[str, Any]:
    spec = manifest["spec"]
    return spec["template"]["spec"] if "template" in spec else spec


def env_map(manifest: dict[str, Any]) -> dict[str, Any]:
    entries = container(manifest)["env"]
    names = [e["name"] for e in entries]
    assert len(names) == len(set(names)), f"duplicate env names: {names}"
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in entries}


def volume(manifest: dict[str, Any], mount_path: str) -> dict[str, Any]:
    (mount,) = [m for m in container(manifest)["volumeMounts"] if m["mountPath"] == mount_path]
    (vol,) = [v for v in pod_spec(manifest)["volumes"] if v["name"] == mount["name"]]
    return {"mount": mount, "volume": vol}


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


# --- the fleet view ------------------------------------------------------------------------------


def _schema_defaults(schema: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    found = {}
    for key, sub in (schema.get("properties") or {}).items():
        path = f"{prefix}{key}"
        if "default" in sub and sub["default"] != {}:
            found[path] = sub["default"]
        found.update(_schema_defaults(sub, path + "."))
    return found


def test_defaults_are_the_crds():
    assert _schema_defaults(SCHEMA["properties"]["spec"]) == DEFAULTS


def test_a_sparse_object_parses_with_the_crd_defaults():
    fleet = parse_fleet(
        {
            "metadata": {"name": "f"},
            "spec": {"proxy": {"tokenizer": {"path": "/tok"}}, "engines": {"modelPath": "/m", "image": "e"}},
        },
        OperatorDefaults(
            proxy_image="r.example/rolloutfleet-proxy:9.9.9", gateway_image="r.example/router:1"
        ),
    )
    assert fleet.namespace == "default"
    assert fleet.proxy.replicas == 1 and fleet.proxy.port == 8000
    assert fleet.proxy.image == "r.example/rolloutfleet-proxy:9.9.9"  # the operator's default
    assert fleet.gateway.image == "r.example/router:1"
    assert fleet.proxy.dump.path == "/var/lib/rolloutfleet/dumps" and fleet.proxy.dump.empty_dir == {}
    assert fleet.proxy.memory.consecutive_samples == 3 and not fleet.proxy.memory.enabled
    assert fleet.gateway.port == 30080 and fleet.gateway.policy == "manual"  # routes by session
    assert fleet.engines is not None and fleet.engines.gpus_per_engine == 1
    assert fleet.engines.tensor_parallel_size == 1 and fleet.engines.port == 30000


def test_parse_reads_metadata_and_the_gpu_sample():
    assert (GPU.name, GPU.namespace, GPU.uid, GPU.generation) == ("gpu-fleet", "rl", "uid-1", 3)
    assert GPU.proxy.memory.rss_budget_bytes == 6442450944 and GPU.proxy.memory.enabled
    assert GPU.proxy.dump.persistent_volume_claim == {"claimName": "rollout-dumps"}
    assert GPU.proxy.dump.empty_dir is None
    assert GPU.external_engine_urls == ()
    assert MINIMAL.engines is None
    assert MINIMAL.external_engine_urls == ("http://sglang-engine-0.sglang:30000",)


@pytest.mark.parametrize(
    "spec",
    [
        {"proxy": {"tokenizer": {"path": "/t"}}},
        {
            "proxy": {"tokenizer": {"path": "/t"}},
            "engines": {"modelPath": "/m"},
            "externalEngineUrls": ["http://e:1"],
        },
        {"proxy": {"tokenizer": {}}, "externalEngineUrls": ["http://e:1"]},
        {"externalEngineUrls": ["http://e:1"]},
        {
            "proxy": {"tokenizer": {"path": "/t"}, "admission": {"consumerBatchSize": 8}},
            "externalEngineUrls": ["http://e:1"],
        },
    ],
)
def test_parse_rejects_what_the_crd_rejects(spec):
    with pytest.raises(ValueError):
        parse_fleet({"metadata": {"name": "f"}, "spec": spec})


def test_names_and_labels():
    assert proxy_pod_name(GPU, 3) == "gpu-fleet-proxy-3"
    assert proxy_ordinal(GPU, "gpu-fleet-proxy-12") == 12
    for other in ["gpu-fleet-proxy-", "gpu-fleet-proxy-01", "gpu-fleet-proxy-x", "other-proxy-1"]:
        assert proxy_ordinal(GPU, other) is None
    assert labels(GPU, "engine") == {
        "app.kubernetes.io/name": "rolloutfleet",
        "app.kubernetes.io/instance": "gpu-fleet",
        "app.kubernetes.io/component": "engine",
        "app.kubernetes.io/managed-by": "rolloutfleet-operator",
        "rolloutfleet.dev/fleet": "gpu-fleet",
    }
    selector = selector_string(GPU, "proxy")
    assert dict(part.split("=") for part in selector.split(",")) == labels(GPU, "proxy")
    names = {headless_service_name(GPU), client_service_name(GPU), gateway_name(GPU), engine_name(GPU)}
    assert len(names) == 4


# --- manifests: every spec field reaches its manifest --------------------------------------------

POD = manifests.proxy_pod(GPU, 2)
GATEWAY = manifests.gateway_deployment(GPU)
ENGINE = manifests.engine_deployment(GPU)
SVC = "gpu-fleet-proxies"


GPU_ROWS = [
    ("proxy replicas", GPU.proxy.replicas, 4),
    ("proxy name", POD["metadata"]["name"], "gpu-fleet-proxy-2"),
    ("proxy ordinal label", POD["metadata"]["labels"]["rolloutfleet.dev/ordinal"], "2"),
    ("proxy image (the operator's default)", container(POD)["image"], operator_defaults().proxy_image),
    ("proxy pull policy", container(POD)["imagePullPolicy"], "IfNotPresent"),
    (
        "proxy resources",
        container(POD)["resources"],
        {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "8Gi"}},
    ),
    ("proxy port", container(POD)["ports"], [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]),
    ("proxy args", container(POD)["args"], ["--host", "0.0.0.0", "--port", "8000"]),
    ("proxy hostname", POD["spec"]["hostname"], "gpu-fleet-proxy-2"),
    ("proxy subdomain", POD["spec"]["subdomain"], SVC),
    ("proxy grace", POD["spec"]["terminationGracePeriodSeconds"], 90),
    ("proxy restart", POD["spec"]["restartPolicy"], "Always"),
    ("readiness", container(POD)["readinessProbe"]["httpGet"], {"path": "/readyz", "port": 8000}),
    ("liveness", container(POD)["livenessProbe"]["httpGet"], {"path": "/healthz", "port": 8000}),
    (
        "tokenizer volume",
        volume(POD, "/models"),
        {
            "mount": {"name": "tokenizer", "mountPath": "/models", "readOnly": True},
            "volume": {
                "name": "tokenizer",
                "persistentVolumeClaim": {"claimName": "model-weights", "readOnly": True},
            },
        },
    ),
    (
        "dump volume",
        volume(POD, "/var/lib/rolloutfleet/dumps")["volume"],
        {"name": "dumps", "persistentVolumeClaim": {"claimName": "rollout-dumps"}},
    ),
    ("tmp volume", volume(POD, "/tmp")["volume"], {"name": "tmp", "emptyDir": {}}),
    ("env: upstream", env_map(POD)[ENV["upstream_url"]], "http://gpu-fleet-gateway.rl.svc:30080"),
    ("env: tokenizer", env_map(POD)[ENV["tokenizer_path"]], "/models"),
    ("env: stale timeout", env_map(POD)[ENV["stale_session_timeout_s"]], "1800"),
    ("env: cleanup interval", env_map(POD)[ENV["cleanup_interval_s"]], "30"),
    ("env: dump dir", env_map(POD)[ENV["dump_dir"]], "/var/lib/rolloutfleet/dumps/gpu-fleet-proxy-2"),
    ("env: drain grace", env_map(POD)[ENV["drain_grace_s"]], "25"),
    ("env: public url", env_map(POD)[ENV["public_url"]], f"http://gpu-fleet-proxy-2.{SVC}.rl.svc:8000"),
    ("env: tool call parser", env_map(POD)[ENV["tool_call_parser"]], "qwen25"),
    ("env: reasoning parser", env_map(POD)[ENV["reasoning_parser"]], "qwen3"),
    (
        "env: admin key",
        env_map(POD)[ENV["admin_key"]],
        {"secretKeyRef": {"name": "gpu-fleet-admin-key", "key": "admin-key"}},
    ),
    ("env: no downward-API pod ip (binds the wildcard)", "POD_IP" in env_map(POD), False),
    ("env: extra", env_map(POD)["ROLLOUTFLEET_PROXY_LOG_LEVEL"], "info"),
    ("extra env last", container(POD)["env"][-1]["name"], "ROLLOUTFLEET_PROXY_LOG_LEVEL"),
    (
        "gateway image (the operator's default)",
        container(GATEWAY)["image"],
        operator_defaults().gateway_image,
    ),
    ("gateway replicas", GATEWAY["spec"]["replicas"], 1),
    ("gateway policy", flag(container(GATEWAY)["args"], "--policy"), "manual"),
    ("gateway port", flag(container(GATEWAY)["args"], "--port"), "30080"),
    ("gateway metrics", flag(container(GATEWAY)["args"], "--prometheus-port"), "29000"),
    ("gateway resources", container(GATEWAY)["resources"], {"requests": {"cpu": "1", "memory": "1Gi"}}),
    ("gateway account", pod_spec(GATEWAY)["serviceAccountName"], "gpu-fleet-gateway"),
    (
        "gateway readiness",
        container(GATEWAY)["readinessProbe"]["httpGet"],
        {"path": "/readiness", "port": 30080},  # 503 while no worker is healthy
    ),
    ("gateway liveness", container(GATEWAY)["livenessProbe"]["httpGet"], {"path": "/health", "port": 30080}),
    ("gateway discovery port", flag(container(GATEWAY)["args"], "--service-discovery-port"), "30000"),
    ("gateway discovery ns", flag(container(GATEWAY)["args"], "--service-discovery-namespace"), "rl"),
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
    ("gateway binds the wildcard", flag(container(GATEWAY)["args"], "--host"), "0.0.0.0"),
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
def test_gpu_sample_reaches_its_manifests(what, actual, expected):
    assert actual == expected, what


def test_gateway_discovers_exactly_the_engine_pods():
    args = container(GATEWAY)["args"]
    assert "--service-discovery" in args and "--worker-urls" not in args
    start = args.index("--selector") + 1
    selector = []
    while not args[start].startswith("--"):
        selector.append(args[start])
        start += 1
    engine_pod_labels = ENGINE["spec"]["template"]["metadata"]["labels"]
    assert dict(s.split("=", 1) for s in selector) == engine_pod_labels
    # And not the proxies or the gateway itself.
    assert not set(selector) & {f"{k}={v}" for k, v in labels(GPU, "proxy").items() if "component" in k}


def test_gateway_options_reach_the_deployment():
    obj = sample("gpu")
    obj["spec"]["gateway"].update(
        {
            "replicas": 3,
            "policy": "round_robin",
            "port": 31000,
            "extraArgs": ["--log-level", "warn"],
            "nodeSelector": {"pool": "cpu"},
            "tolerations": [{"key": "dedicated", "operator": "Exists"}],
            "image": "router:1",
        }
    )
    fleet = parse_fleet(obj)
    deployment = manifests.gateway_deployment(fleet)
    args = container(deployment)["args"]
    assert deployment["spec"]["replicas"] == 3
    assert container(deployment)["image"] == "router:1"
    assert flag(args, "--policy") == "round_robin" and flag(args, "--port") == "31000"
    assert args[-2:] == ["--log-level", "warn"]
    assert pod_spec(deployment)["nodeSelector"] == {"pool": "cpu"}
    assert pod_spec(deployment)["tolerations"] == [{"key": "dedicated", "operator": "Exists"}]
    service = manifests.gateway_service(fleet)
    assert service["spec"]["ports"][0]["port"] == 31000
    assert service["spec"]["selector"] == deployment["spec"]["template"]["metadata"]["labels"]
    assert (
        env_map(manifests.proxy_pod(fleet, 0))[ENV["upstream_url"]] == "http://gpu-fleet-gateway.rl.svc:31000"
    )


def test_external_engines_use_worker_urls_and_no_engine_deployment():
    obj = sample("minimal")
    obj["spec"]["externalEngineUrls"] = ["http://a:30000", "http://b:30000"]
    fleet = parse_fleet(obj)
    args = container(manifests.gateway_deployment(fleet))["args"]
    index = args.index("--worker-urls")
    assert args[index + 1 : index + 3] == ["http://a:30000", "http://b:30000"]
    assert "--service-discovery" not in args and "--selector" not in args
    kinds = [(c["kind"], c["metadata"]["name"]) for c in manifests.desired_children(fleet)]
    assert ("Deployment", "minimal-engine") not in kinds
    assert ("Deployment", "minimal-gateway") in kinds
    with pytest.raises(ValueError):
        manifests.engine_deployment(fleet)


def test_minimal_sample_defaults_reach_the_pod():
    pod = manifests.proxy_pod(MINIMAL, 0)
    env = env_map(pod)
    assert env[ENV["dump_dir"]] == "/var/lib/rolloutfleet/dumps/minimal-proxy-0"
    assert env[ENV["upstream_url"]] == "http://minimal-gateway.rl.svc:30080"
    assert volume(pod, "/var/lib/rolloutfleet/dumps")["volume"] == {"name": "dumps", "emptyDir": {}}
    # The proxy image holds no tokenizer: the sample mounts the model's claim, read-only, where the
    # proxy loads it from.
    tokenizer = volume(pod, "/models")
    assert env[ENV["tokenizer_path"]] == "/models" and tokenizer["mount"]["readOnly"] is True
    assert tokenizer["volume"] == {
        "name": "tokenizer",
        "persistentVolumeClaim": {"claimName": "model-weights", "readOnly": True},
    }
    assert [v["name"] for v in pod["spec"]["volumes"]] == ["tokenizer", "dumps", "tmp"]
    assert "resources" not in container(pod)
    assert pod["spec"]["terminationGracePeriodSeconds"] == 60


@pytest.mark.parametrize(
    ("dump", "expected"),
    [
        (
            {"hostPath": {"path": "/srv/dumps"}},
            {"hostPath": {"path": "/srv/dumps", "type": "DirectoryOrCreate"}},
        ),
        ({"emptyDir": {"sizeLimit": "1Gi"}}, {"emptyDir": {"sizeLimit": "1Gi"}}),
        ({"persistentVolumeClaim": {"claimName": "c"}}, {"persistentVolumeClaim": {"claimName": "c"}}),
        ({}, {"emptyDir": {}}),
    ],
)
def test_dump_volume_kinds(dump, expected):
    obj = sample("minimal")
    obj["spec"]["proxy"]["dump"] = {"path": "/dumps", **dump}
    pod = manifests.proxy_pod(parse_fleet(obj), 1)
    found = volume(pod, "/dumps")
    assert found["volume"] == {"name": "dumps", **expected}
    assert env_map(pod)[ENV["dump_dir"]] == "/dumps/minimal-proxy-1"


def test_extra_env_overrides_an_injected_setting_and_the_spec_admin_secret_is_used():
    obj = sample("minimal")
    obj["spec"]["proxy"]["env"] = [
        {"name": ENV["drain_grace_s"], "value": "5"},
        {"name": "EXTRA", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "k"}}},
    ]
    obj["spec"]["proxy"]["adminKeySecret"] = {"name": "mine", "key": "token"}
    fleet = parse_fleet(obj)
    pod = manifests.proxy_pod(fleet, 0)
    env = env_map(pod)  # also asserts each name appears once
    assert env[ENV["drain_grace_s"]] == "5"
    assert [e["name"] for e in container(pod)["env"]][-2:] == [ENV["drain_grace_s"], "EXTRA"]
    assert env[ENV["admin_key"]] == {"secretKeyRef": {"name": "mine", "key": "token"}}
    assert not fleet.generates_admin_key and GPU.generates_admin_key


def pod_settings(pod: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> ProxySettings:
    """The proxy settings of the pod's env and args, as the kubelet would resolve them."""
    for name in list(os.environ):
        if name.startswith("ROLLOUTFLEET_PROXY_"):
            monkeypatch.delenv(name)
    for entry in container(pod)["env"]:
        if "value" in entry:
            monkeypatch.setenv(entry["name"], entry["value"])
        elif "secretKeyRef" in entry["valueFrom"]:
            monkeypatch.setenv(entry["name"], "secret")
    return load_settings(container(pod)["args"])


def test_injected_settings_load_in_the_proxy(monkeypatch):
    """The pod's env and args, as the kubelet would resolve them, are valid proxy settings."""
    settings = pod_settings(manifests.proxy_pod(GPU, 1), monkeypatch)
    assert settings.host == "0.0.0.0" and settings.port == 8000
    assert settings.upstream_url == "http://gpu-fleet-gateway.rl.svc:30080"
    assert settings.tokenizer_path == "/models"
    assert settings.stale_session_timeout_s == 1800 and settings.cleanup_interval_s == 30
    assert str(settings.dump_dir) == "/var/lib/rolloutfleet/dumps/gpu-fleet-proxy-1"
    assert settings.drain_grace_s == 25
    assert settings.public_url == f"http://gpu-fleet-proxy-1.{SVC}.rl.svc:8000"
    assert settings.admin_key.get_secret_value() == "secret"
    assert settings.log_level == "info"
    assert settings.tool_call_parser == "qwen25" and settings.reasoning_parser == "qwen3"
    assert settings.chat_template_kwargs == {}


# --- the served model's chat formats (SGLang's parser names, default chat template keywords) -----

CHAT_FORMAT_ENV = {ENV["tool_call_parser"], ENV["reasoning_parser"], ENV["chat_template_kwargs"]}
KWARGS = {"enable_thinking": False, "thinking_budget": 512, "tools": {"strict": True, "order": [2, 1]}}


def proxy_schema(field: str) -> dict[str, Any]:
    return SCHEMA["properties"]["spec"]["properties"]["proxy"]["properties"][field]


def test_crd_parser_names_are_the_proxys_registries():
    """One source of truth: the CRD offers exactly the parsers the proxy has (SGLang's names)."""
    for field, registry in (
        ("toolCallParser", TOOL_CALL_PARSER_NAMES),
        ("reasoningParser", REASONING_PARSER_NAMES),
    ):
        enum = proxy_schema(field)["enum"]
        assert len(enum) == len(set(enum)) and set(enum) == set(registry), field
        assert proxy_schema(field)["type"] == "string" and "SGLang" in proxy_schema(field)["description"]
    kwargs = proxy_schema("chatTemplateKwargs")
    # Without it the API server would prune every key of the object (it declares no properties).
    assert kwargs["type"] == "object" and kwargs["x-kubernetes-preserve-unknown-fields"] is True


def test_chat_formats_reach_the_proxy_when_set(monkeypatch):
    obj = sample("minimal")
    obj["spec"]["proxy"].update(
        toolCallParser="llama3", reasoningParser="deepseek-r1", chatTemplateKwargs=KWARGS
    )
    fleet = parse_fleet(obj)
    assert (fleet.proxy.tool_call_parser, fleet.proxy.reasoning_parser) == ("llama3", "deepseek-r1")
    assert fleet.proxy.chat_template_kwargs == KWARGS and fleet.proxy.chat_template_kwargs is not KWARGS
    pod = manifests.proxy_pod(fleet, 0)
    env = env_map(pod)
    assert env[ENV["tool_call_parser"]] == "llama3" and env[ENV["reasoning_parser"]] == "deepseek-r1"
    assert env[ENV["chat_template_kwargs"]] == (
        '{"enable_thinking":false,"thinking_budget":512,"tools":{"order":[2,1],"strict":true}}'
    )
    # They round-trip through the proxy's settings: a JSON object in, the same dict out (also in
    # what GET /v1/settings reports, which the e2e suite compares with the pod's env).
    settings = pod_settings(pod, monkeypatch)
    assert (settings.tool_call_parser, settings.reasoning_parser) == ("llama3", "deepseek-r1")
    assert settings.chat_template_kwargs == KWARGS
    reported = effective_settings(settings)
    assert reported["chat_template_kwargs"] == json.loads(env[ENV["chat_template_kwargs"]]) == KWARGS
    assert reported["tool_call_parser"] == env[ENV["tool_call_parser"]]
    assert reported["reasoning_parser"] == env[ENV["reasoning_parser"]]


@pytest.mark.parametrize(
    "proxy",
    [
        {},
        {"chatTemplateKwargs": {}},
        {"toolCallParser": None, "reasoningParser": None, "chatTemplateKwargs": None},
    ],
    ids=["absent", "empty keywords", "null"],
)
def test_chat_formats_are_not_injected_when_unset(proxy, monkeypatch):
    obj = sample("minimal")
    obj["spec"]["proxy"].update(proxy)
    fleet = parse_fleet(obj)
    assert fleet.proxy.tool_call_parser is None and fleet.proxy.reasoning_parser is None
    assert fleet.proxy.chat_template_kwargs == {}
    pod = manifests.proxy_pod(fleet, 0)
    assert not CHAT_FORMAT_ENV & set(env_map(pod))
    # The proxy's defaults apply; and an unset field does not change the pod (no roll on upgrade).
    settings = pod_settings(pod, monkeypatch)
    for field in ("tool_call_parser", "reasoning_parser", "chat_template_kwargs"):
        default = ProxySettings.model_fields[field].get_default(call_default_factory=True)
        assert getattr(settings, field) == default, field
    assert manifests.template_hash(fleet) == manifests.template_hash(MINIMAL)


def test_chat_template_kwargs_json_is_stable():
    """The same keywords in another key order give the same value and hash; another value rolls."""
    reordered = {"tools": {"order": [2, 1], "strict": True}, "thinking_budget": 512, "enable_thinking": False}
    assert reordered == KWARGS and list(reordered) != list(KWARGS)
    assert list(reordered["tools"]) != list(KWARGS["tools"])
    fleets = [parse_fleet(_mutated("proxy.chatTemplateKwargs", kwargs)) for kwargs in (KWARGS, reordered)]
    values = {env_map(manifests.proxy_pod(fleet, 0))[ENV["chat_template_kwargs"]] for fleet in fleets}
    assert len(values) == 1
    assert json.loads(values.pop()) == KWARGS
    assert manifests.template_hash(fleets[0]) == manifests.template_hash(fleets[1])
    flipped = parse_fleet(_mutated("proxy.chatTemplateKwargs", {**KWARGS, "enable_thinking": True}))
    assert manifests.template_hash(flipped) != manifests.template_hash(fleets[0])
    # A list's order is data, not layout: it is kept, and changing it is a change.
    tools = {"strict": True, "order": [1, 2]}
    swapped = parse_fleet(_mutated("proxy.chatTemplateKwargs", {**KWARGS, "tools": tools}))
    assert manifests.template_hash(swapped) != manifests.template_hash(fleets[0])


def test_chat_formats_are_template_settings():
    assert not CHAT_FORMAT_ENV & manifests.HASH_EXEMPT_ENV


def test_proxy_pod_is_locked_down():
    pod_security = POD["spec"]["securityContext"]
    assert pod_security["fsGroup"] == 65532 and pod_security["runAsNonRoot"] is True
    security = container(POD)["securityContext"]
    assert security == {
        "runAsNonRoot": True,
        "runAsUser": 65532,
        "runAsGroup": 65532,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert POD["spec"]["enableServiceLinks"] is False


@pytest.mark.parametrize("gpus", [0, 1, 4])
def test_gpu_limit_follows_gpus_per_engine(gpus):
    obj = sample("gpu")
    obj["spec"]["engines"]["gpusPerEngine"] = gpus
    obj["spec"]["engines"]["tensorParallelSize"] = 1
    limits = container(manifests.engine_deployment(parse_fleet(obj)))["resources"].get("limits", {})
    assert limits.get("nvidia.com/gpu") == (str(gpus) if gpus else None)


def test_services_select_the_proxies_and_expose_the_port():
    headless = manifests.headless_service(GPU)
    client = manifests.client_service(GPU)
    assert headless["metadata"]["name"] == SVC == POD["spec"]["subdomain"]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert client["spec"]["type"] == "ClusterIP"
    for service in (headless, client):
        assert service["spec"]["selector"] == labels(GPU, "proxy")
        assert all(POD["metadata"]["labels"][k] == v for k, v in service["spec"]["selector"].items())
        assert service["spec"]["ports"] == [
            {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}
        ]


def test_gateway_rbac_reads_pods_only():
    role = manifests.gateway_role(GPU)
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = manifests.gateway_role_binding(GPU)
    account = manifests.gateway_service_account(GPU)
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": "rl"}
    ]
    assert pod_spec(GATEWAY)["serviceAccountName"] == account["metadata"]["name"]


def all_children(fleet):
    return [
        *manifests.desired_children(fleet),
        manifests.proxy_pod(fleet, 0),
        manifests.admin_key_secret(fleet, "k"),
    ]


@pytest.mark.parametrize("fleet", [GPU, MINIMAL], ids=["gpu", "minimal"])
def test_every_child_is_owned_by_the_fleet_and_labelled(fleet):
    children = all_children(fleet)
    kinds = {c["kind"] for c in children}
    expected_kinds = {
        "Service",
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "Deployment",
        "Pod",
        "Secret",
        "PodDisruptionBudget",
    }
    assert kinds == expected_kinds
    for child in children:
        meta = child["metadata"]
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "rolloutfleet.dev/v1alpha1",
                "kind": "RolloutFleet",
                "name": fleet.name,
                "uid": "uid-1",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ], meta["name"]
        assert meta["namespace"] == "rl"
        component = meta["labels"]["app.kubernetes.io/component"]
        assert {k: meta["labels"][k] for k in labels(fleet, component)} == labels(fleet, component)
    names = [(c["kind"], c["metadata"]["name"]) for c in children]
    assert len(names) == len(set(names))


def test_admin_key_secret():
    secret = manifests.admin_key_secret(GPU, "s3cret")
    assert secret["metadata"]["name"] == "gpu-fleet-admin-key"
    assert secret["stringData"] == {"admin-key": "s3cret"}


# --- the template hash ---------------------------------------------------------------------------


def _mutated(path: str, value: Any, base: dict[str, Any] | None = None) -> dict[str, Any]:
    obj = sample("gpu") if base is None else base
    node = obj["spec"]
    *parents, last = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return obj


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("proxy.image", "rolloutfleet-proxy:0.2.0"),
        ("proxy.imagePullPolicy", "Always"),
        ("proxy.port", 8001),
        ("proxy.resources", {"limits": {"memory": "16Gi"}}),
        ("proxy.tokenizer.path", "/other"),
        ("proxy.tokenizer.volume", {"hostPath": {"path": "/tok"}}),
        ("proxy.staleSessionTimeoutSeconds", 600),
        ("proxy.cleanupIntervalSeconds", 10),
        ("proxy.drainGraceSeconds", 40),
        ("proxy.terminationGracePeriodSeconds", 120),
        ("proxy.dump.path", "/dumps"),
        ("proxy.dump.persistentVolumeClaim", {"claimName": "other"}),
        ("proxy.env", [{"name": "X", "value": "1"}]),
        ("proxy.adminKeySecret", {"name": "s", "key": "k"}),
        ("proxy.exportTtlSeconds", 60),
        ("proxy.admission", {"maxStaleness": 2, "consumerBatchSize": 8}),
        ("proxy.admission.maxConcurrentSessions", 4),
        ("proxy.toolCallParser", "llama3"),
        ("proxy.toolCallParser", None),
        ("proxy.reasoningParser", "qwen3-thinking"),
        ("proxy.reasoningParser", None),
        ("proxy.chatTemplateKwargs", {"enable_thinking": False}),
        ("gateway.port", 31000),
    ],
)
def test_template_hash_changes_with_the_pod_template(path, value):
    before = manifests.template_hash(GPU)
    after = manifests.template_hash(parse_fleet(_mutated(path, value)))
    assert after != before


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("proxy.replicas", 7),
        ("proxy.memory", {"rssBudgetBytes": 1}),
        ("proxy.memory.rssBudgetBytes", 2 * 2**30),
        ("proxy.memory.refuseNewSessionsPercent", 50),
        ("gateway.replicas", 2),
        ("gateway.image", "router:2"),
        ("gateway.policy", "random"),
        ("engines.replicas", 5),
        ("engines.image", "sglang:2"),
    ],
)
def test_template_hash_ignores_what_is_not_in_the_pod(path, value):
    assert manifests.template_hash(parse_fleet(_mutated(path, value))) == manifests.template_hash(GPU)


def test_scaling_changes_the_batch_share_of_new_pods_without_rolling_the_others():
    admission = {"maxStaleness": 4, "consumerBatchSize": 10}
    fleets = {
        n: parse_fleet(_mutated("proxy.replicas", n, _mutated("proxy.admission", admission))) for n in (3, 4)
    }
    assert manifests.template_hash(fleets[3]) == manifests.template_hash(fleets[4])
    for replicas, share in ((3, "4"), (4, "3")):  # ceil(10 / replicas): the fleet admits a whole batch
        env = {e["name"]: e.get("value") for e in container(manifests.proxy_pod(fleets[replicas], 0))["env"]}
        assert env[ENV["max_staleness"]] == "4" and env[ENV["staleness_batch_share"]] == share


@pytest.mark.parametrize(
    ("replicas", "batch", "share"), [(1, 1, 1), (4, 2, 1), (4, 8, 2), (3, 10, 4), (0, 5, 5)]
)
def test_batch_share_is_rounded_up_and_at_least_one(replicas, batch, share):
    spec = {"maxStaleness": 0, "consumerBatchSize": batch}
    assert parse_fleet(_mutated("proxy.admission", spec)).proxy.admission.batch_share(replicas) == share


def test_memory_soft_limit_and_export_ttl_reach_the_proxy():
    fleet = parse_fleet(
        _mutated("proxy.exportTtlSeconds", 90, _mutated("proxy.memory.refuseNewSessionsPercent", 80))
    )
    env = {e["name"]: e.get("value") for e in container(manifests.proxy_pod(fleet, 0))["env"]}
    assert env[ENV["rss_soft_limit_bytes"]] == str(6442450944 * 80 // 100)
    assert env[ENV["export_ttl_s"]] == "90"
    off = parse_fleet(_mutated("proxy.memory.refuseNewSessionsPercent", 0))
    assert ENV["rss_soft_limit_bytes"] not in {
        e["name"] for e in container(manifests.proxy_pod(off, 0))["env"]
    }
    assert env[ENV["max_staleness"]] == "2" and env[ENV["max_concurrent_sessions"]] == "512"
    unbounded = parse_fleet(_mutated("proxy.admission", {}))
    names = {e["name"] for e in container(manifests.proxy_pod(unbounded, 0))["env"]}
    assert not names & {ENV["max_staleness"], ENV["staleness_batch_share"], ENV["max_concurrent_sessions"]}


def test_template_hash_is_on_every_pod_and_independent_of_the_ordinal():
    current = manifests.template_hash(GPU)
    assert len(current) >= 8
    hashes = {
        manifests.proxy_pod(GPU, i)["metadata"]["annotations"][TEMPLATE_HASH_ANNOTATION] for i in range(4)
    }
    assert hashes == {current}
    # Stable across separately parsed copies of the same object (no randomness, no identity).
    assert manifests.template_hash(parse_fleet(sample("gpu", uid="other", generation=9))) == current


# --- plan ----------------------------------------------------------------------------------------

H = "current"


def pod(ordinal: int, ready: bool = True, hash_: str = H, phase: str = "Running", deleting: bool = False):
    return ProxyPodView(
        name=f"f-proxy-{ordinal}",
        ordinal=ordinal,
        ready=ready,
        phase=phase,
        template_hash=hash_,
        deleting=deleting,
    )


def dels(*items: tuple[int, str]) -> tuple[Deletion, ...]:
    return tuple(Deletion(f"f-proxy-{i}", i, reason) for i, reason in items)


@pytest.mark.parametrize(
    ("case", "desired", "pods", "create", "delete"),
    [
        ("fresh create", 3, [], (0, 1, 2), ()),
        ("steady", 2, [pod(0), pod(1)], (), ()),
        ("scale up", 4, [pod(0), pod(1)], (2, 3), ()),
        ("scale up with a gap", 3, [pod(0), pod(2)], (1,), ()),
        (
            "scale down highest first",
            1,
            [pod(0), pod(1), pod(2), pod(3)],
            (),
            dels((3, "ScaleDown"), (2, "ScaleDown"), (1, "ScaleDown")),
        ),
        ("scale to zero", 0, [pod(0), pod(1)], (), dels((1, "ScaleDown"), (0, "ScaleDown"))),
        (
            "scale down skips terminating",
            1,
            [pod(0), pod(1, deleting=True), pod(2)],
            (),
            dels((2, "ScaleDown")),
        ),
        (
            "roll lowest first, one at a time",
            3,
            [pod(0, hash_="old"), pod(1, hash_="old"), pod(2, hash_="old")],
            (),
            dels((0, "RollingUpdate")),
        ),
        (
            "roll continues with the next outdated",
            3,
            [pod(0), pod(1, hash_="old"), pod(2, hash_="old")],
            (),
            dels((1, "RollingUpdate")),
        ),
        ("no roll while one is unready", 3, [pod(0, hash_="old"), pod(1, ready=False), pod(2)], (), ()),
        ("no roll while one terminates", 3, [pod(0, hash_="old"), pod(1), pod(2, deleting=True)], (), ()),
        (
            "no roll while an excess pod terminates",
            2,
            [pod(0, hash_="old"), pod(1), pod(2, deleting=True)],
            (),
            (),
        ),
        ("no roll while one is missing", 3, [pod(0, hash_="old"), pod(1)], (2,), ()),
        ("missing hash counts as outdated", 1, [pod(0, hash_=None)], (), dels((0, "RollingUpdate"))),
        ("failed pod is deleted", 2, [pod(0), pod(1, ready=False, phase="Failed")], (), dels((1, "Down"))),
        ("gone pod is recreated under its name", 2, [pod(0)], (1,), ()),
        ("terminating pod is not recreated yet", 2, [pod(0), pod(1, ready=False, deleting=True)], (), ()),
        (
            "unready outdated pods are replaced at once",
            3,
            [pod(0, ready=False, hash_="old"), pod(1), pod(2, ready=False, hash_="old")],
            (),
            dels((0, "ReplaceOutdated"), (2, "ReplaceOutdated")),
        ),
        ("create and scale down together", 2, [pod(1), pod(2)], (0,), dels((2, "ScaleDown"))),
    ],
)
def test_plan_proxies(case, desired, pods, create, delete):
    plan = plan_proxies(desired, pods, H)
    assert (plan.create, plan.delete) == (create, delete), case


def test_plan_reports_why_a_roll_waits():
    plan = plan_proxies(2, [pod(0, hash_="old"), pod(1, ready=False)], H)
    assert plan.idle and "f-proxy-1" in (plan.waiting or "")


def test_a_roll_never_takes_two_pods_down():
    """Walk a whole roll of 4 pods: after every step, at most one wanted pod is unavailable."""
    pods = {i: pod(i, hash_="old") for i in range(4)}
    for _ in range(50):
        plan = plan_proxies(4, list(pods.values()), H)
        if plan.idle:
            break
        for deletion in plan.delete:
            pods[deletion.ordinal] = pod(deletion.ordinal, ready=False, deleting=True)
        unavailable = [p for p in pods.values() if not p.ready]
        assert len(unavailable) <= 1
        # The kubelet finishes the deletion; the next passes recreate it and it becomes ready.
        for p in unavailable:
            del pods[p.ordinal]
        plan = plan_proxies(4, list(pods.values()), H)
        for ordinal in plan.create:
            pods[ordinal] = pod(ordinal)
    assert all(p.template_hash == H and p.ready for p in pods.values()) and len(pods) == 4


def test_proxy_pod_view_reads_a_pod():
    obj = manifests.proxy_pod(GPU, 1)
    obj["metadata"]["deletionTimestamp"] = NOW
    obj["status"] = {
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": "True"}],
        "containerStatuses": [
            {"name": "proxy", "restartCount": 4, "state": {"waiting": {"reason": "CrashLoopBackOff"}}}
        ],
    }
    view = proxy_pod_view(obj, 1)
    assert view == ProxyPodView(
        name="gpu-fleet-proxy-1",
        ordinal=1,
        ready=True,
        phase="Running",
        restart_count=4,
        template_hash=manifests.template_hash(GPU),
        deleting=True,
        waiting_reason="CrashLoopBackOff",
    )
    obj["status"]["conditions"] = [
        {"type": "PodScheduled", "status": "True"},
        {"type": "Ready", "status": "False"},
    ]
    assert proxy_pod_view(obj, 1).ready is False
    bare = proxy_pod_view({"metadata": {"name": "x"}}, 0)
    assert (bare.ready, bare.phase, bare.template_hash, bare.deleting) == (False, "Pending", None, False)


# --- conditions and status -----------------------------------------------------------------------


def test_set_condition_keeps_the_transition_time_while_the_status_holds():
    first = set_condition([], Condition("Ready", "False", "Starting", "a"), NOW)
    assert first[0]["lastTransitionTime"] == NOW
    same = set_condition(
        first, Condition("Ready", "False", "StillStarting", "b", observed_generation=2), LATER
    )
    assert same[0]["lastTransitionTime"] == NOW
    assert (same[0]["reason"], same[0]["message"], same[0]["observedGeneration"]) == ("StillStarting", "b", 2)
    flipped = set_condition(same, Condition("Ready", "True", "Up"), LATER)
    assert flipped[0]["lastTransitionTime"] == LATER and flipped[0]["status"] == "True"
    assert first[0]["reason"] == "Starting", "the input list is not modified"


def test_set_condition_keeps_other_types_and_their_order():
    existing = [
        {"type": "A", "status": "True", "reason": "X", "lastTransitionTime": NOW},
        {"type": "B", "status": "True", "reason": "Y", "lastTransitionTime": NOW},
    ]
    result = set_condition(existing, Condition("A", "False", "Z"), LATER)
    assert [c["type"] for c in result] == ["A", "B"]
    assert result[1] == existing[1]
    assert [c["type"] for c in set_condition(existing, Condition("C", "True", "W"), LATER)] == ["A", "B", "C"]


def observed(pods, desired=2, gateway=(1, 1), engines=(2, 2), **kw):
    return ObservedState(
        desired_proxies=desired,
        proxies=tuple(pods),
        current_hash=H,
        gateway_ready=gateway[0],
        gateway_desired=gateway[1],
        engines_ready=engines[0] if engines else None,
        engines_desired=engines[1] if engines else None,
        **kw,
    )


def by_type(conditions):
    return {c["type"]: c for c in conditions}


def statuses(conditions):
    return {c["type"]: c["status"] for c in conditions}


@pytest.mark.parametrize(
    ("case", "state", "expected"),
    [
        (
            "all ready",
            observed([pod(0), pod(1)]),
            {
                "Ready": "True",
                "ProxiesReady": "True",
                "GatewayReady": "True",
                "EnginesReady": "True",
                "Progressing": "False",
                "ReplicaFailure": "False",
            },
        ),
        (
            "creating",
            observed([]),
            {"Ready": "False", "ProxiesReady": "False", "Progressing": "True", "ReplicaFailure": "False"},
        ),
        (
            "rolling",
            observed([pod(0, hash_="old"), pod(1)]),
            {"Ready": "True", "ProxiesReady": "True", "Progressing": "True"},
        ),
        (
            "gateway down",
            observed([pod(0), pod(1)], gateway=(0, 1)),
            {"Ready": "False", "GatewayReady": "False"},
        ),
        (
            "engines down",
            observed([pod(0), pod(1)], engines=(1, 2)),
            {"Ready": "False", "EnginesReady": "False"},
        ),
        (
            "external engines",
            observed([pod(0), pod(1)], engines=None),
            {"Ready": "True", "EnginesReady": "True"},
        ),
        (
            "crash loop",
            observed(
                [
                    pod(0),
                    ProxyPodView(
                        "f-proxy-1",
                        1,
                        ready=False,
                        phase="Running",
                        restart_count=CRASHLOOP_RESTARTS,
                        template_hash=H,
                    ),
                ]
            ),
            {"Ready": "False", "ReplicaFailure": "True", "Progressing": "True"},
        ),
        (
            "failed pod",
            observed([pod(0), pod(1, ready=False, phase="Failed")]),
            {"Ready": "False", "ReplicaFailure": "True"},
        ),
        (
            "restarted but ready again is no failure",
            observed(
                [
                    pod(0),
                    ProxyPodView(
                        "f-proxy-1", 1, ready=True, phase="Running", restart_count=9, template_hash=H
                    ),
                ]
            ),
            {"Ready": "True", "ReplicaFailure": "False"},
        ),
        (
            "failed create",
            observed([pod(0), pod(1)], create_failures=("f-proxy-2: exceeded quota",), desired=3),
            {"Ready": "False", "ReplicaFailure": "True"},
        ),
        (
            "scaled to zero",
            observed([], desired=0),
            {"Ready": "True", "ProxiesReady": "True", "Progressing": "False"},
        ),
        ("scaling down", observed([pod(0), pod(1), pod(2)]), {"Ready": "True", "Progressing": "True"}),
    ],
)
def test_fleet_conditions(case, state, expected):
    conditions = fleet_conditions(state, 5, NOW, [])
    found = statuses(conditions)
    assert {k: found[k] for k in expected} == expected, case
    assert set(found) == {
        "Ready",
        "ProxiesReady",
        "GatewayReady",
        "EnginesReady",
        "Progressing",
        "ReplicaFailure",
    }
    for condition in conditions:
        assert condition["observedGeneration"] == 5 and condition["lastTransitionTime"] == NOW
        assert condition["reason"][:1].isupper() and condition["reason"].isalnum()


def test_condition_reasons_and_messages():
    crashing = ProxyPodView("f-proxy-1", 1, ready=False, restart_count=2, waiting_reason="CrashLoopBackOff")
    conditions = by_type(fleet_conditions(observed([pod(0), crashing]), 1, NOW, []))
    assert conditions["ReplicaFailure"]["reason"] == "CrashLoop"
    assert "f-proxy-1" in conditions["ReplicaFailure"]["message"]
    assert conditions["Ready"]["reason"] == "ProxiesNotReady"
    assert "f-proxy-1" in conditions["ProxiesReady"]["message"]
    external = by_type(fleet_conditions(observed([pod(0), pod(1)], engines=None), 1, NOW, []))
    assert external["EnginesReady"]["reason"] == "NotManaged"
    failed = by_type(fleet_conditions(observed([pod(0), pod(1, ready=False, phase="Failed")]), 1, NOW, []))
    assert failed["ReplicaFailure"]["reason"] == "PodFailed"


def test_fleet_conditions_transitions_and_foreign_conditions():
    watchdog = {
        "type": "MemoryRestarting",
        "status": "False",
        "reason": "WithinBudget",
        "lastTransitionTime": NOW,
    }
    starting = fleet_conditions(observed([pod(0), pod(1, ready=False)]), 1, NOW, [watchdog])
    assert by_type(starting)["MemoryRestarting"] == watchdog
    # Same state later: nothing moves.
    assert fleet_conditions(observed([pod(0), pod(1, ready=False)]), 1, LATER, starting) == starting
    ready = by_type(fleet_conditions(observed([pod(0), pod(1)]), 2, LATER, starting))
    assert ready["Ready"]["status"] == "True" and ready["Ready"]["lastTransitionTime"] == LATER
    assert ready["GatewayReady"]["lastTransitionTime"] == NOW  # was True already
    assert ready["GatewayReady"]["observedGeneration"] == 2
    assert ready["MemoryRestarting"] == watchdog


def test_fleet_status_counts_and_endpoints():
    pods = [
        pod(1),
        pod(0, hash_="old"),
        pod(2, ready=False),
        pod(3, deleting=True),
        pod(4, ready=False, phase="Failed"),
    ]
    state = observed(pods, desired=3)
    status = fleet_status(GPU, state, NOW)
    assert status["observedGeneration"] == 3
    assert (status["replicas"], status["readyReplicas"], status["updatedReplicas"]) == (3, 2, 2)
    assert status["selector"] == selector_string(GPU, "proxy")
    assert status["gatewayUrl"] == "http://gpu-fleet-gateway.rl.svc:30080"
    assert status["proxyEndpoints"] == [
        f"http://gpu-fleet-proxy-0.{SVC}.rl.svc:8000",
        f"http://gpu-fleet-proxy-1.{SVC}.rl.svc:8000",
    ]
    assert by_type(status["conditions"])["Ready"]["status"] == "False"
    # The endpoint of a ready proxy is the public URL the proxy itself was given.
    assert status["proxyEndpoints"][0] == env_map(manifests.proxy_pod(GPU, 0))[ENV["public_url"]]


def _unknown_keys(value: Any, schema: dict[str, Any], path: str) -> list[str]:
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        found = []
        for key, sub in value.items():
            if key not in props:
                found.append(f"{path}.{key}")
            else:
                found += _unknown_keys(sub, props[key], f"{path}.{key}")
        return found
    if isinstance(value, list):
        return [k for item in value for k in _unknown_keys(item, schema.get("items") or {}, f"{path}[]")]
    return []


def test_status_uses_only_fields_of_the_crd_status_schema():
    status_schema = SCHEMA["properties"]["status"]
    status = fleet_status(GPU, observed([pod(0), pod(1, hash_="old")], desired=2), NOW)
    assert _unknown_keys(status, status_schema, "status") == []
    # The check itself notices an extra field.
    assert _unknown_keys({**status, "extra": 1}, status_schema, "status") == ["status.extra"]
    enum = status_schema["properties"]["conditions"]["items"]["properties"]["status"]["enum"]
    assert {c["status"] for c in status["conditions"]} <= set(enum)
    # Integer fields really are integers, strings strings.
    types = {"integer": int, "string": str, "array": list}
    for key, value in status.items():
        assert isinstance(value, types[status_schema["properties"][key]["type"]]), key


def test_children_do_not_share_mutable_state_with_the_fleet():
    pod_a = manifests.proxy_pod(GPU, 0)
    container(pod_a)["resources"]["limits"]["memory"] = "1Gi"
    pod_spec(manifests.engine_deployment(GPU))["tolerations"].append({"key": "x"})
    assert GPU.proxy.resources["limits"]["memory"] == "8Gi"
    assert len(GPU.engines.placement.tolerations) == 1
    assert manifests.proxy_pod(GPU, 2) == POD


def test_switching_to_external_engines_makes_the_engine_deployment_unwanted():
    # Without NetworkPolicies in the operator's settings, any a fleet has are unwanted.
    policies = [
        ("networking.k8s.io/v1", "NetworkPolicy", f"gpu-fleet-{c}") for c in ("proxy", "gateway", "engine")
    ]
    assert manifests.unwanted_children(GPU) == policies
    external = _mutated("externalEngineUrls", ["http://e:1"])
    del external["spec"]["engines"]
    assert manifests.unwanted_children(parse_fleet(external)) == [
        ("apps/v1", "Deployment", "gpu-fleet-engine"),
        ("v1", "Service", "gpu-fleet-engines"),
        ("policy/v1", "PodDisruptionBudget", "gpu-fleet-engine"),
        *policies,
    ]


def _pod_with(ready: bool, phase: str = "Running") -> dict[str, Any]:
    condition = {"type": "Ready", "status": "True" if ready else "False"}
    return {"metadata": {"name": "p"}, "status": {"phase": phase, "conditions": [condition]}}


@pytest.mark.parametrize(
    ("event_type", "pod", "was_ready", "needed"),
    [
        ("DELETED", _pod_with(True), True, True),
        ("MODIFIED", _pod_with(False, "Failed"), False, True),
        ("MODIFIED", _pod_with(True), False, True),  # became Ready: a roll may go on
        ("MODIFIED", _pod_with(False), True, True),  # lost readiness: the status should say so
        ("MODIFIED", _pod_with(True), True, False),  # nothing that matters changed
        (None, _pod_with(True), None, False),  # the first listing: the resume pass covers it
        ("ADDED", _pod_with(False, "Pending"), None, False),
    ],
)
def test_pod_event_needs_pass(event_type, pod, was_ready, needed):
    from rolloutfleet_operator.plan import pod_event_needs_pass

    assert pod_event_needs_pass(event_type, pod, was_ready) is needed


# --- what real SGLang needs (issue #12) -----------------------------------------------------------


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
    fleet = parse_fleet(_mutated("proxy.engineLogprobs", "original"))
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
    moved = parse_fleet(_mutated("gateway.metricsPort", 29100))
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
