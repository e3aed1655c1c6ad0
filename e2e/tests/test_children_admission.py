"""Every child the operator builds for the samples is accepted by a real API server (a server-side
dry run: the API's schemas and defaulting, name rules and admission), also for a fleet with the
longest name the CRD allows; and the pods meet the Pod Security levels docs/operator.md states,
checked against namespaces that enforce them: proxies and the gateway `restricted`, engines
`baseline` (and, with GPU images running as root, not `restricted`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from rolloutfleet_operator.fleet import (
    MAX_FLEET_NAME_LENGTH,
    NETWORK_POLICY_ENV,
    Fleet,
    OperatorDefaults,
    parse_fleet,
)
from rolloutfleet_operator.manifests.admin_key import admin_key_secret
from rolloutfleet_operator.manifests.children import desired_children
from rolloutfleet_operator.manifests.engines import engine_deployment
from rolloutfleet_operator.manifests.gateway import gateway_deployment, gateway_service_account
from rolloutfleet_operator.manifests.proxy_pod import proxy_pod
from rolloutfleet_testkit.waiting import wait_for

pytestmark = pytest.mark.e2e

SAMPLES = Path(__file__).resolve().parents[2] / "operator" / "samples"


# The operator's settings with NetworkPolicies on (what the chart's networkPolicy values produce).
WITH_POLICIES = OperatorDefaults.from_environment(
    {
        NETWORK_POLICY_ENV: json.dumps(
            {
                "operatorNamespace": "rolloutfleet-system",
                "clientNamespaces": {"matchLabels": {"team": "rl"}},
                "scrapeNamespaces": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
            }
        )
    },
    "0.0.0",
)


def sample_fleet(
    sample: str, namespace: str, name: str | None = None, defaults: OperatorDefaults | None = None
) -> Fleet:
    obj = yaml.safe_load((SAMPLES / f"{sample}.yaml").read_text())
    obj["metadata"].update({"namespace": namespace, "uid": "00000000-0000-0000-0000-000000000001"})
    if name is not None:
        obj["metadata"]["name"] = name
    return parse_fleet(obj, defaults)


def every_child(fleet: Fleet) -> list[dict[str, Any]]:
    pods = [proxy_pod(fleet, i) for i in range(fleet.proxy.replicas)]
    return [*desired_children(fleet), admin_key_secret(fleet, "k"), *pods]


def as_pod(manifest: dict[str, Any]) -> dict[str, Any]:
    """A Deployment's pod template as the Pod its ReplicaSet would create (Pod Security is enforced
    on pods; on a Deployment it only warns)."""
    if manifest["kind"] == "Pod":
        return manifest
    template = manifest["spec"]["template"]
    metadata = {
        **template["metadata"],
        "name": f"{manifest['metadata']['name']}-x",
        "namespace": manifest["metadata"]["namespace"],
    }
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": template["spec"]}


def dry_run(cluster, objects: list[dict[str, Any]]):
    listing = json.dumps({"apiVersion": "v1", "kind": "List", "items": objects})
    return cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=listing, check=False)


@pytest.mark.parametrize(
    ("sample", "name", "defaults"),
    [
        ("minimal", None, None),
        ("gpu", None, None),
        ("gpu", "g" * MAX_FLEET_NAME_LENGTH, None),
        ("gpu", None, WITH_POLICIES),
        ("minimal", None, WITH_POLICIES),
    ],
    ids=["minimal", "gpu", "gpu-longest-name", "gpu-network-policies", "minimal-network-policies"],
)
def test_every_child_passes_a_server_side_dry_run(cluster, namespace, sample, name, defaults):
    fleet = sample_fleet(sample, namespace, name, defaults)
    children = every_child(fleet)
    assert {c["kind"] for c in children} >= {"Pod", "Service", "Deployment", "PodDisruptionBudget"}
    if defaults is WITH_POLICIES:
        assert sum(c["kind"] == "NetworkPolicy" for c in children) == (3 if fleet.engines else 2)
    result = dry_run(cluster, children)
    assert result.returncode == 0, result.stderr
    # The longest proxy pod name the fleet can have (ordinal 999) is a valid pod too.
    if name is not None:
        longest = proxy_pod(fleet, 999)
        assert len(longest["metadata"]["name"]) == 63
        result = dry_run(cluster, [longest])
        assert result.returncode == 0, result.stderr


@pytest.fixture
def enforcing(cluster, namespace):
    def label(level: str) -> str:
        cluster.kubectl(
            "label", "namespace", namespace, f"pod-security.kubernetes.io/enforce={level}", "--overwrite"
        )
        return namespace

    return label


COMPONENT_PODS = {
    "proxy": lambda fleet: proxy_pod(fleet, 0),
    "gateway": lambda fleet: as_pod(gateway_deployment(fleet)),
    "engine": lambda fleet: as_pod(engine_deployment(fleet)),
}


@pytest.mark.parametrize(
    ("level", "component", "admitted"),
    [
        ("restricted", "proxy", True),
        ("restricted", "gateway", True),
        ("restricted", "engine", False),
        ("baseline", "engine", True),
    ],
)
def test_pod_security_levels(cluster, enforcing, level, component, admitted):
    namespace = enforcing(level)
    fleet = sample_fleet("gpu", namespace)
    # The router's pod names its ServiceAccount, which must exist (a dry run persists nothing), and be
    # in the admission plugin's cache, which follows the API by a moment. Without its ownerReference:
    # the fleet it names does not exist, so the garbage collector would delete it at once.
    account = gateway_service_account(fleet)
    del account["metadata"]["ownerReferences"]
    cluster.kubectl("apply", "-f", "-", input=json.dumps(account))
    pod = COMPONENT_PODS[component](fleet)

    def admitted_or_refused():
        result = dry_run(cluster, [pod])
        return None if "error looking up service account" in result.stderr else result

    result = wait_for(
        admitted_or_refused, timeout_s=30, what="the ServiceAccount to reach the admission plugin"
    )
    if admitted:
        assert result.returncode == 0, result.stderr
    else:
        assert result.returncode != 0 and "violates PodSecurity" in result.stderr, result.stderr
