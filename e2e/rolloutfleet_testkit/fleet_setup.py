"""The sample GPU fleet and the operator's chart, made to run on the local cluster.

Shared by the main job (`./dev demo`) and the operator's e2e tests. `local_fleet` starts from
`operator/samples/gpu.yaml` and changes only what this machine cannot provide: volumes become
hostPaths (the locally built test tokenizer stands in for the model; the process kubelet runs the
CPU reference engine, a test stand-in for SGLang, for the engine image), and resource requests
shrink to fit the process kubelet's nodes. Everything else is the sample as users apply it.
"""

from __future__ import annotations

import base64
import copy
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "rolloutfleet-operator"
CRDS = ROOT / "crds"
GPU_SAMPLE = ROOT / "operator" / "samples" / "gpu.yaml"
OPERATOR_IMAGE = "rolloutfleet-operator"  # the process kubelet runs `python -m rolloutfleet_operator`


def local_fleet(
    name: str,
    namespace: str,
    tokenizer_dir: str | Path,
    dump_dir: str | Path,
    proxies: int | None = None,
    engines: int | None = None,
    memory: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The GPU sample, adapted to the local cluster (pure apart from reading the sample file)."""
    fleet = yaml.safe_load(GPU_SAMPLE.read_text())
    fleet["metadata"] = {"name": name, "namespace": namespace}
    proxy, engine = fleet["spec"]["proxy"], fleet["spec"]["engines"]
    if proxies is not None:
        proxy["replicas"] = proxies
    if engines is not None:
        engine["replicas"] = engines
    proxy["resources"] = {"requests": {"cpu": "100m", "memory": "256Mi"}}
    proxy["tokenizer"]["volume"] = {"hostPath": {"path": str(tokenizer_dir), "type": "Directory"}}
    proxy["dump"] = {"path": proxy["dump"]["path"], "hostPath": {"path": str(dump_dir)}}
    proxy["terminationGracePeriodSeconds"] = 30
    proxy["drainGraceSeconds"] = 10
    proxy["memory"] = copy.deepcopy(memory) if memory is not None else {"rssBudgetBytes": 0}
    fleet["spec"]["gateway"]["resources"] = {"requests": {"cpu": "100m", "memory": "128Mi"}}
    engine["resources"] = {"requests": {"cpu": "500m", "memory": "1Gi"}}
    engine["modelPath"] = "/models"
    engine["volumes"] = [{"name": "model", "hostPath": {"path": str(tokenizer_dir), "type": "Directory"}}]
    engine["volumeMounts"] = [{"name": "model", "mountPath": "/models", "readOnly": True}]
    return fleet


def helm_install_args(
    release: str, namespace: str, watch_namespaces: list[str], extra: dict[str, str] | None = None
) -> list[str]:
    """`helm upgrade --install` arguments for the operator's chart (after the helm binary)."""
    values = {
        "image.repository": OPERATOR_IMAGE,
        "watchNamespaces": "{" + ",".join(watch_namespaces) + "}",
        "resources.requests.cpu": "100m",
        **(extra or {}),
    }
    sets = [arg for key, value in values.items() for arg in ("--set", f"{key}={value}")]
    return [
        "upgrade",
        "--install",
        release,
        str(CHART),
        "--namespace",
        namespace,
        *sets,
        "--wait",
        "--timeout",
        "180s",
    ]


def admin_key(secret: dict[str, Any]) -> str:
    """The proxies' admin key from the fleet's generated Secret (a kubectl -o json document)."""
    return base64.b64decode(secret["data"]["admin-key"]).decode()


def pod_urls(pods: dict[str, Any], port: int) -> dict[str, str]:
    """Pod name → http://podIP:port for a `kubectl get pods -o json` listing (IPs reach pods here)."""
    return {
        pod["metadata"]["name"]: f"http://{pod['status']['podIP']}:{port}"
        for pod in pods["items"]
        if (pod.get("status") or {}).get("podIP") and not pod["metadata"].get("deletionTimestamp")
    }
