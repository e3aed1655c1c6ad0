"""Every child of a fleet together (manifests/children.py): owned by the fleet, labelled, uniquely
named within Kubernetes' limits, with disruption budgets for proxies and engines."""

from __future__ import annotations

import pytest
from fleet_samples import GPU, IMAGES, MINIMAL, fleet_with, gpu_sample
from rolloutfleet_operator.fleet import labels, parse_fleet
from rolloutfleet_operator.manifests.admin_key import admin_key_secret
from rolloutfleet_operator.manifests.children import desired_children
from rolloutfleet_operator.manifests.proxy_pod import proxy_pod


def all_children(fleet):
    return [*desired_children(fleet), proxy_pod(fleet, 0), admin_key_secret(fleet, "k")]


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


def test_disruption_budgets_for_proxies_and_engines():
    fleet = fleet_with("engines", maxUnavailable=0)
    budgets = {
        c["metadata"]["name"]: c for c in desired_children(fleet) if c["kind"] == "PodDisruptionBudget"
    }
    assert budgets["gpu-fleet-proxy"]["spec"] == {
        "maxUnavailable": fleet.proxy.memory.max_unavailable,
        "selector": {"matchLabels": labels(fleet, "proxy")},
    }
    assert budgets["gpu-fleet-engine"]["spec"] == {
        "maxUnavailable": 0,
        "selector": {"matchLabels": labels(fleet, "engine")},
    }


@pytest.mark.parametrize("length", [53, 54])
def test_fleet_names_too_long_for_their_children_are_refused(length):
    obj = gpu_sample()
    obj["metadata"]["name"] = "f" * length
    if length > 53:
        with pytest.raises(ValueError, match="at most 53"):
            parse_fleet(obj, IMAGES)
        return
    fleet = parse_fleet(obj, IMAGES)
    names = [c["metadata"]["name"] for c in desired_children(fleet)]
    names.append(proxy_pod(fleet, 999)["metadata"]["name"])
    assert max(len(n) for n in names) == 63
