"""The proxy pod (manifests/proxy_pod.py): every spec field reaches it; volumes, probes, identity,
and a locked-down security context."""

from __future__ import annotations

import pytest
from fleet_samples import GPU, MINIMAL, POD, SVC, container, env_map, fleet_with, sample, volume
from rolloutfleet_operator.fleet import operator_defaults, parse_fleet
from rolloutfleet_operator.manifests.proxy_pod import proxy_pod
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
]


@pytest.mark.parametrize(("what", "actual", "expected"), GPU_ROWS, ids=[row[0] for row in GPU_ROWS])
def test_gpu_sample_reaches_the_proxy_pod(what, actual, expected):
    assert actual == expected, what


def test_minimal_sample_defaults_reach_the_pod():
    pod = proxy_pod(MINIMAL, 0)
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
    pod = proxy_pod(parse_fleet(obj), 1)
    found = volume(pod, "/dumps")
    assert found["volume"] == {"name": "dumps", **expected}
    assert env_map(pod)[ENV["dump_dir"]] == "/dumps/minimal-proxy-1"


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


def test_proxy_identity_and_env_from():
    env_from = [{"secretRef": {"name": "s3-credentials"}}]
    pod = proxy_pod(fleet_with("proxy", serviceAccountName="dumps-writer", envFrom=env_from), 0)
    assert pod["spec"]["serviceAccountName"] == "dumps-writer"
    assert pod["spec"]["automountServiceAccountToken"] is False  # the proxy never calls the API
    assert pod["spec"]["containers"][0]["envFrom"] == env_from
