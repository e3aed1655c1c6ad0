"""The manifests: every spec field reaches its manifest; the children are owned, labelled and locked down."""

from __future__ import annotations

import pytest
from fleet_samples import (
    ENGINE,
    GATEWAY,
    GPU,
    MINIMAL,
    POD,
    SVC,
    container,
    env_map,
    flag,
    pod_settings,
    pod_spec,
    sample,
    volume,
)
from rolloutfleet_operator import manifests
from rolloutfleet_operator.fleet import labels, operator_defaults, parse_fleet
from rolloutfleet_proxy.settings import ENV

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
