"""Leader election's pure rules (who creates, takes over, renews or waits) and the standby's health
endpoint; the Lease against a real API server and a killed leader are in tests/e2e/test_operator_ha.py."""

from __future__ import annotations

import datetime

import httpx
import pytest
from rolloutfleet_operator.leadership import Election, StandbyHealth, lease_action, lease_spec
from rolloutfleet_testkit.processes import free_port

NOW = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.UTC)
ELECTION = Election(namespace="ops", name="rolloutfleet-operator", identity="op-a", lease_duration_s=15)


def lease(holder: str | None, renewed_s_ago: float | None, duration: int = 15) -> dict:
    spec: dict = {"leaseDurationSeconds": duration}
    if holder is not None:
        spec["holderIdentity"] = holder
    if renewed_s_ago is not None:
        spec["renewTime"] = (NOW - datetime.timedelta(seconds=renewed_s_ago)).strftime(
            "%Y-%m-%dT%H:%M:%S.%fZ"
        )
    return {"metadata": {"resourceVersion": "7"}, "spec": spec}


@pytest.mark.parametrize(
    ("current", "action"),
    [
        (None, "create"),
        (lease("op-a", 3), "renew"),
        (lease("op-a", 60), "renew"),  # our own, even late: renewing it is still ours to do
        (lease("op-b", 3), "wait"),
        (lease("op-b", 14.9), "wait"),
        (lease("op-b", 15), "take"),  # expired
        (lease(None, 3), "take"),  # released
        (lease("op-b", None), "take"),  # never renewed
    ],
)
def test_lease_action(current, action):
    assert lease_action(current, "op-a", NOW) == action


def test_lease_spec_records_the_holder_and_counts_transitions():
    created = lease_spec(ELECTION, NOW, None, "create")
    assert created == {
        "holderIdentity": "op-a",
        "leaseDurationSeconds": 15,
        "acquireTime": "2026-01-01T12:00:00.000000Z",
        "renewTime": "2026-01-01T12:00:00.000000Z",
        "leaseTransitions": 0,
    }
    taken = lease_spec(
        ELECTION, NOW, {"spec": {**created, "holderIdentity": "op-b", "leaseTransitions": 2}}, "take"
    )
    assert taken["holderIdentity"] == "op-a" and taken["leaseTransitions"] == 3
    later = NOW + datetime.timedelta(seconds=5)
    renewed = lease_spec(ELECTION, later, {"spec": taken}, "renew")
    assert renewed["acquireTime"] == taken["acquireTime"] and renewed["leaseTransitions"] == 3
    assert renewed["renewTime"] == "2026-01-01T12:00:05.000000Z"


def test_a_standby_answers_its_probes_and_frees_the_port_for_kopf():
    port = free_port()
    standby = StandbyHealth("127.0.0.1", port)
    try:
        response = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
        assert response.status_code == 200 and response.text == "standby\n"
    finally:
        standby.close()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
    StandbyHealth("127.0.0.1", port).close()  # the port can be bound again at once
