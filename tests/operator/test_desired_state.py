"""Change detection for the fleet's children (desired_state.py): the desired-hash annotation and the
comparison of a desired manifest with the object as the API server stores it."""

from __future__ import annotations

import copy

import pytest
from fleet_samples import GPU, MINIMAL
from rolloutfleet_operator.desired_state import (
    CHANGED,
    DRIFTED,
    MISSING,
    apply_reason,
    desired_hash,
    drifted_fields,
    with_desired_hash,
)
from rolloutfleet_operator.fleet import DESIRED_HASH_ANNOTATION
from rolloutfleet_operator.manifests.children import desired_children
from rolloutfleet_operator.manifests.gateway import gateway_deployment


def as_stored(manifest: dict) -> dict:
    """Roughly what the API server gives back: defaults and status added, empty values dropped."""
    stored = copy.deepcopy(manifest)
    stored["metadata"].update({"uid": "u", "resourceVersion": "7", "managedFields": [{"manager": "x"}]})
    stored["status"] = {"readyReplicas": 1}
    if stored["kind"] == "Deployment":
        stored["spec"]["progressDeadlineSeconds"] = 600
        pod = stored["spec"]["template"]["spec"]
        pod["dnsPolicy"] = "ClusterFirst"
        for container in pod["containers"]:
            container["terminationMessagePath"] = "/dev/termination-log"
    return stored


def test_the_hash_is_stable_and_leaves_its_own_annotation_out():
    deployment = gateway_deployment(GPU)
    stamped = with_desired_hash(deployment)
    assert stamped["metadata"]["annotations"][DESIRED_HASH_ANNOTATION] == desired_hash(deployment)
    assert desired_hash(stamped) == desired_hash(deployment)
    assert desired_hash(copy.deepcopy(deployment)) == desired_hash(deployment)
    assert (
        "annotations" not in deployment["metadata"]
        or DESIRED_HASH_ANNOTATION not in deployment["metadata"]["annotations"]
    )


def test_the_hash_follows_any_change_of_the_manifest():
    deployment = gateway_deployment(GPU)
    changed = copy.deepcopy(deployment)
    changed["spec"]["replicas"] += 1
    assert desired_hash(changed) != desired_hash(deployment)


@pytest.mark.parametrize("fleet", [GPU, MINIMAL], ids=["gpu", "minimal"])
def test_every_child_as_stored_needs_no_apply(fleet):
    for manifest in desired_children(fleet):
        desired = with_desired_hash(manifest)
        assert apply_reason(desired, as_stored(desired)) is None, manifest["kind"]


def test_a_missing_child_is_applied():
    assert apply_reason(with_desired_hash(gateway_deployment(GPU)), None) == MISSING


def test_a_child_applied_from_another_manifest_is_applied():
    old = gateway_deployment(GPU)
    new = copy.deepcopy(old)
    new["spec"]["template"]["spec"]["containers"][0]["args"].append("--removed-later")
    # A field removed from the manifest is invisible to the drift check: the hash finds it.
    assert apply_reason(with_desired_hash(old), as_stored(with_desired_hash(new))) == CHANGED
    # So is a child an older operator applied without any hash.
    assert apply_reason(with_desired_hash(old), as_stored(old)) == CHANGED


def test_a_child_edited_by_hand_is_applied():
    desired = with_desired_hash(gateway_deployment(GPU))
    stored = as_stored(desired)
    stored["spec"]["replicas"] = 5  # kubectl scale deploy
    assert apply_reason(desired, stored) == DRIFTED
    assert drifted_fields(desired, stored) == [".spec.replicas"]


def test_fields_added_by_the_server_or_others_are_not_drift():
    desired = {"spec": {"ports": [{"port": 80}], "selector": {"a": "1"}}}
    stored = {
        "spec": {"ports": [{"port": 80, "protocol": "TCP"}], "selector": {"a": "1"}, "clusterIP": "10.0.0.1"}
    }
    assert drifted_fields(desired, stored) == []


@pytest.mark.parametrize("empty", [[], {}, "", False, 0, None])
def test_values_the_server_drops_when_empty_count_as_absent(empty):
    assert drifted_fields({"spec": {"x": empty, "y": 1}}, {"spec": {"y": 1}}) == []


def test_quantities_compare_by_value():
    assert drifted_fields({"cpu": "0.5", "memory": "1024Mi"}, {"cpu": "500m", "memory": "1Gi"}) == []
    assert drifted_fields({"cpu": "1"}, {"cpu": "500m"}) == [".cpu"]
    assert drifted_fields({"name": "http"}, {"name": "https"}) == [".name"]


def test_lists_must_match_item_by_item():
    assert drifted_fields({"args": ["a", "b"]}, {"args": ["a"]}) == [".args"]
    assert drifted_fields({"args": ["a", "b"]}, {"args": ["b", "a"]}) == [".args[0]", ".args[1]"]


def test_a_value_of_another_type_is_drift():
    assert drifted_fields({"port": 80}, {"port": "80"}) == [".port"]
    assert drifted_fields({"on": True}, {"on": 1}) == [".on"]
