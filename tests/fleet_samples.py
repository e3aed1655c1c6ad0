"""What the operator's unit tests share (tests/operator/ and tests/operator/manifests/): the sample
fleets parsed, their main manifests, and helpers that read manifests or build pod views and mutated
samples."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from rolloutfleet_operator.fleet import OperatorDefaults, parse_fleet
from rolloutfleet_operator.manifests.engines import engine_deployment
from rolloutfleet_operator.manifests.gateway import gateway_deployment
from rolloutfleet_operator.manifests.proxy_pod import proxy_pod
from rolloutfleet_operator.plan import ProxyPodView
from rolloutfleet_proxy.settings import ProxySettings, load_settings

ROOT = Path(__file__).resolve().parents[1]
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


POD = proxy_pod(GPU, 2)
GATEWAY = gateway_deployment(GPU)
ENGINE = engine_deployment(GPU)
SVC = "gpu-fleet-proxies"


def mutated(path: str, value: Any, base: dict[str, Any] | None = None) -> dict[str, Any]:
    obj = sample("gpu") if base is None else base
    node = obj["spec"]
    *parents, last = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return obj


def pod_template(manifest: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(metadata, spec) of a Pod or of a Deployment's pod template."""
    if manifest["kind"] == "Pod":
        return manifest["metadata"], manifest["spec"]
    template = manifest["spec"]["template"]
    return template["metadata"], template["spec"]


# Images the operator's environment would name, and a placement block for any component.
IMAGES = OperatorDefaults(
    proxy_image="reg.example/rolloutfleet-proxy:1.2.3", gateway_image="reg.example/router:0.3.2"
)
PLACEMENT = {
    "nodeSelector": {"pool": "cpu"},
    "tolerations": [{"key": "pool", "operator": "Equal", "value": "cpu", "effect": "NoSchedule"}],
    "affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
                ]
            }
        }
    },
    "priorityClassName": "rollouts-high",
    "imagePullSecrets": [{"name": "registry"}],
    "podLabels": {"kueue.x-k8s.io/queue-name": "rl", "cost-center": "42"},
    "podAnnotations": {"example.com/owner": "rl-team"},
}
# The operator's NetworkPolicy settings, as the chart puts them in its environment.
POLICY_JSON = json.dumps(
    {
        "operatorNamespace": "rolloutfleet-system",
        "clientNamespaces": {"matchLabels": {"team": "rl"}},
        "scrapeNamespaces": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
    }
)


def gpu_sample() -> dict[str, Any]:
    return sample("gpu", generation=1)


def fleet_with(component: str, **fields: Any):
    """The GPU sample with `fields` set in `spec.<component>`, parsed with IMAGES."""
    obj = gpu_sample()
    obj["spec"].setdefault(component, {}).update(copy.deepcopy(fields))
    return parse_fleet(obj, IMAGES)


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
