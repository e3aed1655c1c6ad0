"""The reconciler's requests (reconcile.py) against a recording stand-in for the API, with the
watch caches filled as the API server would fill them: a pass over a fleet at rest makes none; a
spec change applies only what it changed; unwanted children are looked for only after a spec
change; the admin-key Secret is checked once; status goes out by server-side apply of the
reconciler's own fields, so the watchdog's are never written over, and nothing is applied when the
cached status already holds them (that the API server merges two field managers' conditions by
type is checked against a real one: e2e/tests/test_kubeapi_apply.py); a pass acts on the newest
spec; pods are the fleet's by owner uid; a proxy lost with its node is reported and force-deleted
after its timeout; a roll step is decided from the pods as the API server lists them."""

from __future__ import annotations

import asyncio
import copy

import pytest
from fleet_samples import sample
from recording_api import READY, RecordingApi, cluster_at_rest
from rolloutfleet_operator.desired_state import with_desired_hash
from rolloutfleet_operator.fleet import parse_fleet
from rolloutfleet_operator.manifests.engines import engine_deployment
from rolloutfleet_operator.manifests.proxy_pod import proxy_pod
from rolloutfleet_operator.reconcile import Reconciler
from rolloutfleet_operator.watch_cache import FleetStore, OwnedObjects


def reconciler_for(
    body: dict, indexes: dict | None = None, wall_clock=None
) -> tuple[Reconciler, RecordingApi, dict]:
    api = RecordingApi(body)
    fleets = FleetStore()
    fleets.put(api.fleet)
    indexes = indexes if indexes is not None else cluster_at_rest(body)
    clock = {"wall_clock": wall_clock} if wall_clock else {}
    return Reconciler(api, fleets, OwnedObjects(indexes), **clock), api, indexes  # type: ignore[arg-type]


def proxy_pods_of(indexes: dict, body: dict) -> list[dict]:
    return indexes[("v1", "Pod")][(body["metadata"]["namespace"], body["metadata"]["name"])]


def condition(api: RecordingApi, kind: str) -> dict:
    return next(c for c in api.fleet["status"]["conditions"] if c["type"] == kind)


@pytest.mark.parametrize("name", ["minimal", "gpu"])
async def test_a_fleet_at_rest_costs_no_request(name):
    body = sample(name)
    reconciler, api, _ = reconciler_for(body)
    await reconciler.reconcile(body)
    # The first pass: the admin-key Secret is checked once (minimal generates it), the status
    # applied once by the reconciler; no child is applied.
    assert [c for c in api.calls if c[0] == "apply"] == []
    assert [c for c in api.calls if c[0] == "apply-status"] == [("apply-status", "rolloutfleet-reconciler")]
    api.calls.clear()
    for _ in range(3):
        await reconciler.reconcile(body)
    assert api.calls == []


async def test_a_spec_change_applies_what_it_changed_only():
    body = sample("gpu")
    reconciler, api, _ = reconciler_for(body)
    await reconciler.reconcile(body)
    api.calls.clear()
    changed = copy.deepcopy(body)
    changed["spec"]["gateway"]["assignmentMode"] = "min_group"
    changed["metadata"]["generation"] += 1
    await reconciler.reconcile(changed)
    applies = [c[1] for c in api.calls if c[0] == "apply"]
    assert applies == ["Deployment/" + changed["metadata"]["name"] + "-gateway"]


async def test_a_child_missing_from_the_cache_is_applied_again():
    body = sample("gpu")
    indexes = cluster_at_rest(body)
    key = ("rl", body["metadata"]["name"])
    services = indexes[("v1", "Service")][key]
    removed = services.pop(0)  # deleted by hand: its DELETED event removed it from the cache
    reconciler, api, _ = reconciler_for(body, indexes)
    await reconciler.reconcile(body)
    assert [c[1] for c in api.calls if c[0] == "apply"] == [f"Service/{removed['metadata']['name']}"]


async def test_unwanted_children_are_looked_for_when_the_spec_changed_only():
    body = sample("minimal")  # external engines: an engine Deployment is not wanted
    fleet = parse_fleet(sample("gpu") | {"metadata": body["metadata"]})
    indexes = cluster_at_rest(body)
    leftover = with_desired_hash(engine_deployment(fleet))
    indexes[("apps/v1", "Deployment")][("rl", fleet.name)].append(leftover)
    reconciler, api, _ = reconciler_for(body, indexes)
    await reconciler.reconcile(body)
    assert ("delete", f"deployments/{leftover['metadata']['name']}") in api.calls
    api.calls.clear()
    await reconciler.reconcile(body)  # still in the cache (its DELETED event not yet seen)
    assert [c for c in api.calls if c[0] == "delete"] == []
    body["metadata"]["generation"] += 1
    await reconciler.reconcile(body)
    assert [c[0] for c in api.calls if c[0] == "delete"] == ["delete"]


async def test_an_unwanted_child_of_another_owner_is_left_alone():
    body = sample("minimal")
    fleet = parse_fleet(sample("gpu") | {"metadata": body["metadata"]})
    indexes = cluster_at_rest(body)
    foreign = with_desired_hash(engine_deployment(fleet))
    foreign["metadata"]["ownerReferences"][0]["uid"] = "someone-else"
    indexes[("apps/v1", "Deployment")][("rl", fleet.name)].append(foreign)
    reconciler, api, _ = reconciler_for(body, indexes)
    await reconciler.reconcile(body)
    assert [c for c in api.calls if c[0] == "delete"] == []


async def test_the_status_applies_only_the_reconciler_s_fields_even_from_a_stale_cache():
    body = sample("gpu")
    reconciler, api, _ = reconciler_for(body)
    await reconciler.reconcile(body)
    applied = api.fleet["status"]
    assert {c["type"] for c in applied["conditions"]} == {
        "Ready",
        "Available",
        "ProxiesReady",
        "GatewayReady",
        "EnginesReady",
        "Progressing",
        "ReplicaFailure",
        "ProxiesLost",
    }
    # The memory watchdog applied its fields meanwhile; the cache has not seen them yet.
    api.fleet["status"]["conditions"].append({"type": "MemoryPressure", "status": "True"})
    api.fleet["status"]["memoryRestarts"] = {"total": 1}
    stale = copy.deepcopy(api.fleet)
    stale["status"]["conditions"] = [
        c for c in stale["status"]["conditions"] if c["type"] != "MemoryPressure"
    ]
    stale["status"]["readyReplicas"] = 0  # a value the pass will want to change
    reconciler.fleets.put(stale)
    api.calls.clear()
    await reconciler.reconcile(body)
    assert api.calls == [("apply-status", "rolloutfleet-reconciler")]  # no read before the write
    assert {"type": "MemoryPressure", "status": "True"} in api.fleet["status"]["conditions"]
    assert api.fleet["status"]["memoryRestarts"] == {"total": 1}
    assert api.fleet["status"]["readyReplicas"] == parse_fleet(body).proxy.replicas


async def test_the_admin_key_secret_is_checked_once_per_fleet():
    body = sample("minimal")
    reconciler, api, _ = reconciler_for(body)
    for _ in range(3):
        await reconciler.reconcile(body)
    secret_reads = [c for c in api.calls if c[0] == "get" and "/secrets/" in c[1]]
    assert len(secret_reads) == 1
    reconciler.forget("rl", body["metadata"]["name"])  # the fleet was deleted: a new one checks again
    await reconciler.reconcile(body)
    assert len([c for c in api.calls if c[0] == "get" and "/secrets/" in c[1]]) == 2


async def test_a_refused_proxy_pod_is_retried_with_backoff_and_still_reported():
    body = sample("minimal")
    indexes = cluster_at_rest(body)
    key = ("rl", body["metadata"]["name"])
    indexes[("v1", "Pod")][key] = []  # no proxy pod yet
    reconciler, api, _ = reconciler_for(body, indexes)
    api.refuse_pods = True
    results = [await reconciler.reconcile(body) for _ in range(3)]  # passes that pod events ask for
    pod_creates = [c for c in api.calls if c[0] == "create" and "-proxy-" in c[1]]
    assert len(pod_creates) == 1, "asked once; the next attempt waits for its backoff"
    assert all(r.failures and "Pod/minimal-proxy-0" in r.failures[0] for r in results)
    failure = next(c for c in api.fleet["status"]["conditions"] if c["type"] == "ReplicaFailure")
    assert failure["reason"] == "FailedCreate" and "minimal-proxy-0" in failure["message"]


async def test_a_pass_that_waited_for_the_lock_acts_on_the_newest_spec_and_a_late_one_is_skipped():
    body = sample("minimal")
    reconciler, api, _ = reconciler_for(body)
    await reconciler.reconcile(body)
    api.calls.clear()
    newer = copy.deepcopy(api.fleet)
    newer["metadata"]["generation"] += 1
    newer["spec"]["proxy"]["replicas"] = parse_fleet(body).proxy.replicas + 1
    lock = reconciler.lock_for("rl", body["metadata"]["name"])
    async with lock:  # a pod-event pass waits while the newer spec arrives
        waiting = asyncio.create_task(reconciler.reconcile(body))
        await asyncio.sleep(0)
        reconciler.fleets.put(newer)
    result = await waiting
    new_pod = f"{body['metadata']['name']}-proxy-{newer['spec']['proxy']['replicas'] - 1}"
    assert result.created == [new_pod]  # scaled to the newer spec's replicas
    # An event of the older spec handled late: nothing is done from it.
    reconciler.fleets.put(body)  # the cache, too, may deliver an older body (the watch resumed)
    api.calls.clear()
    late = await reconciler.reconcile(body)
    assert late.stale and api.calls == []


async def test_pods_of_another_owner_are_never_the_fleets_and_orphans_are_adopted():
    body = sample("minimal")
    indexes = cluster_at_rest(body)
    pods = proxy_pods_of(indexes, body)
    fleet = parse_fleet(body)
    name = fleet.name
    orphan = {**proxy_pod(fleet, 1), "status": READY}
    orphan["metadata"] = {**orphan["metadata"], "uid": "orphan-uid"}
    del orphan["metadata"]["ownerReferences"]
    foreign = {**proxy_pod(fleet, 2), "status": READY}
    foreign["metadata"] = {**foreign["metadata"], "uid": "old-pod"}
    foreign["metadata"]["ownerReferences"] = [
        {**foreign["metadata"]["ownerReferences"][0], "uid": "old-fleet"}
    ]
    body["spec"]["proxy"]["replicas"] = 3
    api_body = copy.deepcopy(body)
    pods[:] = [p for p in pods if p["metadata"]["name"] == f"{name}-proxy-0"] + [orphan, foreign]
    reconciler, api, _ = reconciler_for(api_body, indexes)
    result = await reconciler.reconcile(api_body)
    (adopt,) = [c for c in api.calls if c[0] == "adopt"]
    assert adopt[1] == f"{name}-proxy-1" and adopt[2]["metadata"]["uid"] == "orphan-uid"
    assert adopt[2]["metadata"]["ownerReferences"][0]["uid"] == fleet.uid
    assert adopt[3] == "application/strategic-merge-patch+json"
    assert result.adopted == [f"{name}-proxy-1"]
    # The earlier fleet's pod: not created over, not deleted, not counted; reported.
    assert not [c for c in api.calls if c[0] in ("create", "delete", "evict") and name in str(c[1])]
    assert result.failures == [f"Pod/{name}-proxy-2: the name is held by a pod this fleet does not own"]
    assert api.fleet["status"]["readyReplicas"] == 2


def lost_pod(indexes: dict, body: dict, ordinal: int, deletion: str, node: str) -> None:
    pod = proxy_pods_of(indexes, body)[ordinal]
    pod["metadata"] = {**pod["metadata"], "deletionTimestamp": deletion, "uid": f"pod-{ordinal}"}
    pod["spec"] = {**pod["spec"], "nodeName": node}
    pod["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "False"}]}


async def test_a_proxy_lost_with_its_node_is_reported_at_once_and_force_deleted_after_its_timeout():
    body = sample("minimal")
    body["spec"]["proxy"]["replicas"] = 2
    body["spec"]["proxy"]["lostProxyTimeoutSeconds"] = 120
    indexes = cluster_at_rest(body)
    grace_end = 1_767_225_600.0  # 2026-01-01T00:00:00Z
    now = {"t": grace_end - 5}
    reconciler, api, _ = reconciler_for(body, indexes, wall_clock=lambda: now["t"])
    await reconciler.reconcile(body)
    assert not [c for c in api.calls if c[0] == "get" and "/nodes/" in c[1]]  # at rest: no node read
    lost_pod(indexes, body, 1, "2026-01-01T00:00:00Z", "rf-gpu-node")
    api.nodes["rf-gpu-node"] = {"status": {"conditions": [{"type": "Ready", "status": "Unknown"}]}}
    name = f"{body['metadata']['name']}-proxy-1"
    api.calls.clear()
    result = await reconciler.reconcile(body)  # within its grace period: just terminating
    assert not [c for c in api.calls if "/nodes/" in str(c)] and not result.lost
    now["t"] = grace_end + 1
    result = await reconciler.reconcile(body)
    assert [p.pod for p in result.lost] == [name] and not result.force_deleted
    lost = condition(api, "ProxiesLost")
    assert (lost["status"], lost["reason"]) == ("True", "NodeLost")
    assert f"{name} on rf-gpu-node (NotReady, force-deleted at 2026-01-01T00:02:00Z)" in lost["message"]
    assert not [c for c in api.calls if c[0] == "delete"]
    now["t"] = grace_end + 60
    assert not (await reconciler.reconcile(body)).lost  # reported once
    now["t"] = grace_end + 120
    api.calls.clear()
    result = await reconciler.reconcile(body)
    assert [p.pod for p in result.force_deleted] == [name]
    deletes = [c for c in api.calls if c[0] == "delete"]
    assert deletes == [
        ("delete", f"pods/{name}", {"gracePeriodSeconds": 0, "preconditions": {"uid": "pod-1"}})
    ]
    assert condition(api, "ProxiesLost")["status"] == "False"


async def test_a_terminating_proxy_on_a_ready_node_is_not_lost():
    body = sample("minimal")
    indexes = cluster_at_rest(body)
    lost_pod(indexes, body, 0, "2026-01-01T00:00:00Z", "rf-cpu-node")
    reconciler, api, _ = reconciler_for(body, indexes, wall_clock=lambda: 1_767_225_600.0 + 3600)
    api.nodes["rf-cpu-node"] = {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    result = await reconciler.reconcile(body)
    assert not result.lost and not [c for c in api.calls if c[0] == "delete"]
    assert condition(api, "ProxiesLost")["status"] == "False"


async def test_a_roll_step_is_decided_again_from_the_pods_the_api_server_lists():
    body = sample("minimal")
    body["spec"]["proxy"]["replicas"] = 2
    indexes = cluster_at_rest(body)
    pods = proxy_pods_of(indexes, body)
    for index, pod in enumerate(pods):  # built from an older template: a roll is due
        pod["metadata"] = {**pod["metadata"], "uid": f"pod-{index}"}
        pod["metadata"]["annotations"] = {
            **pod["metadata"]["annotations"],
            "rolloutfleet.dev/template-hash": "old",
        }
    reconciler, api, _ = reconciler_for(body, indexes)
    # The cache shows both Ready; the API server knows proxy-1 is being evicted (a drain, a memory restart).
    api.pods = copy.deepcopy(pods)
    api.pods[1]["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    await reconciler.reconcile(body)
    assert ("list", "Pod") in api.calls
    assert not [c for c in api.calls if c[0] == "evict"]
    api.pods = copy.deepcopy(pods)  # as the cache shows it: the roll goes on, with the pod's uid
    api.calls.clear()
    await reconciler.reconcile(body)
    assert [c for c in api.calls if c[0] == "evict"] == [
        ("evict", f"{body['metadata']['name']}-proxy-0", "pod-0")
    ]
