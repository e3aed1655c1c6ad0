"""Hand-made engines and router for the router-discovery e2e test (independent of the operator):
SGLang emulators (test stand-ins for SGLang) on the GPU node and the real SGLang router with
Kubernetes service discovery in front of them.

Pure builders: each returns the manifests as dicts.
"""

from __future__ import annotations

from typing import Any

from rolloutfleet_testkit.images.catalog import image_name

ENGINE_PORT = 30000
ROUTER_PORT = 30080
PROXY_PORT = 8000
ENGINE_LABELS = {"app.kubernetes.io/name": "sample-engine"}
# images/sglang-emulator: the SGLang emulator behind SGLang's own command line (a test stand-in for
# lmsysorg/sglang, which needs a GPU); images/testkit: the real sglang-router.
# Tagged with the project's version (pyproject.toml), as the images catalog names them.
EMULATOR_IMAGE = image_name("sglang-emulator")
TESTKIT_IMAGE = image_name("testkit")


def _http_probe(path: str, port: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": 1, "failureThreshold": 60}


def router_rbac(namespace: str) -> list[dict[str, Any]]:
    """The router's service discovery lists and watches pods: exactly that, in this namespace."""
    meta = {"name": "sample-router", "namespace": namespace}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": meta,
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": meta,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "sample-router"},
            "subjects": [{"kind": "ServiceAccount", "name": "sample-router", "namespace": namespace}],
        },
    ]


def engines(namespace: str, replicas: int, tokenizer_dir: str) -> dict[str, Any]:
    """SGLang engine Deployment on GPU nodes (the SGLang emulator's image stands in for SGLang's)."""
    container = {
        "name": "engine",
        "image": EMULATOR_IMAGE,
        "command": ["python3", "-m", "sglang.launch_server"],
        "args": [
            "--model-path",
            "/models/tokenizer",
            "--host",
            "0.0.0.0",
            "--port",
            str(ENGINE_PORT),
            "--tp-size",
            "1",
        ],
        "resources": {"limits": {"nvidia.com/gpu": "1"}},
        "volumeMounts": [{"name": "model", "mountPath": "/models/tokenizer", "readOnly": True}],
        "readinessProbe": _http_probe("/health", ENGINE_PORT),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "sample-engine", "namespace": namespace},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": ENGINE_LABELS},
            "template": {
                "metadata": {"labels": ENGINE_LABELS},
                "spec": {
                    "containers": [container],
                    "nodeSelector": {"nvidia.com/gpu.present": "true"},
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                    "volumes": [{"name": "model", "hostPath": {"path": tokenizer_dir, "type": "Directory"}}],
                },
            },
        },
    }


def router(namespace: str) -> dict[str, Any]:
    selector = [f"{k}={v}" for k, v in ENGINE_LABELS.items()]
    container = {
        "name": "router",
        "image": TESTKIT_IMAGE,
        "command": ["python3", "-m", "sglang_router.launch_router"],
        "args": [
            "--host",
            "0.0.0.0",
            "--port",
            str(ROUTER_PORT),
            "--service-discovery",
            "--selector",
            *selector,
            "--service-discovery-port",
            str(ENGINE_PORT),
            "--service-discovery-namespace",
            namespace,
            "--policy",
            "round_robin",
            "--prometheus-host",
            "0.0.0.0",
            "--prometheus-port",
            "29000",
            "--log-level",
            "warn",
        ],
        "readinessProbe": _http_probe("/health", ROUTER_PORT),
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "sample-router",
            "namespace": namespace,
            "labels": {"app.kubernetes.io/name": "sample-router"},
        },
        "spec": {"serviceAccountName": "sample-router", "containers": [container]},
    }
