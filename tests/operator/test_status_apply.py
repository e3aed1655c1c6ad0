"""What each status writer applies, and when: only its own fields, only when one differs."""

from __future__ import annotations

from rolloutfleet_operator.status_apply import owned_fields_differ, status_patch

STORED = {
    "readyReplicas": 2,
    "memoryRestarts": {"total": 1},
    "conditions": [
        {"type": "Ready", "status": "True", "reason": "AllComponentsReady"},
        {"type": "MemoryPressure", "status": "False", "reason": "WithinBudget"},
    ],
}


def test_owned_fields_are_compared_with_the_stored_ones_of_their_type_only():
    ready = {"type": "Ready", "status": "True", "reason": "AllComponentsReady"}
    assert not owned_fields_differ(STORED, {"readyReplicas": 2, "conditions": [ready]})
    # Another writer's condition or field is none of its business.
    assert not owned_fields_differ({**STORED, "conditions": [ready, {"type": "X"}]}, {"conditions": [ready]})
    assert owned_fields_differ(STORED, {"readyReplicas": 3, "conditions": [ready]})
    assert owned_fields_differ(STORED, {"conditions": [{**ready, "message": "new"}]})
    assert owned_fields_differ(STORED, {"conditions": [{"type": "Available", "status": "True"}]})  # absent
    assert owned_fields_differ({}, {"memoryRestarts": {"total": 1}})


def test_the_apply_configuration_names_the_fleet_and_carries_only_the_owned_fields():
    patch = status_patch("rl", "f", {"memoryRestarts": {"total": 2}})
    assert patch == {
        "apiVersion": "rolloutfleet.dev/v1alpha1",
        "kind": "RolloutFleet",
        "metadata": {"name": "f", "namespace": "rl"},
        "status": {"memoryRestarts": {"total": 2}},
    }
