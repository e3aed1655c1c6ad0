"""The reconciler's requests (reconcile.py) against a recording stand-in for the API, with the
watch caches filled as the API server would fill them: a pass over a fleet at rest makes none; a
spec change applies only what it changed; unwanted children are looked for only after a spec
change; the admin-key Secret is checked once; status goes out by server-side apply of the
reconciler's own fields, so the watchdog's are never written over, and nothing is applied when the
cached status already holds them. (That the API server merges two field managers' conditions by
type is checked against a real one: e2e/tests/test_kubeapi_apply.py.)"""

from __future__ import annotations

import copy

import pytest
from fleet_samples import sample
from kubernetes.client.exceptions import ApiException
from rolloutfleet_operator.desired_state import with_desired_hash
from rolloutfleet_operator.fleet import parse_fleet
from rolloutfleet_operator.manifests.children import desired_children
from rolloutfleet_operator.manifests.engines import engine_deployment
from rolloutfleet_operator.manifests.proxy_pod import proxy_pod
from rolloutfleet_operator.reconcile import Reconciler
from rolloutfleet_operator.watch_cache import CACHED_KINDS, FleetStore, OwnedObjects, by_fleet

READY = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}], "podIP": "10.0.0.9"}


class RecordingApi:
    """The calls the reconciler makes; the fleet's status lives here as on the API server."""

    def __init__(self, fleet: dict):
        self.fleet = copy.deepcopy(fleet)
        self.fleet["metadata"]["resourceVersion"] = "1"
        self.calls: list[tuple[str, str]] = []
        self.refuse_pods = False

    def apply_reporting(self, obj: dict):
        self.calls.append(("apply", f"{obj['kind']}/{obj['metadata']['name']}"))
        return obj, False

    def get(self, path: str):
        self.calls.append(("get", path))
        return copy.deepcopy(self.fleet) if "rolloutfleets" in path else {"kind": "Secret"}

    def create(self, path: str, body: dict):
        self.calls.append(("create", body["metadata"]["name"]))
        if body["kind"] == "Pod" and self.refuse_pods:
            raise ApiException(status=403, reason="Forbidden")
        return body

    def delete(self, path: str, body=None):
        self.calls.append(("delete", path.rsplit("/", 2)[-2] + "/" + path.rsplit("/", 1)[-1]))
        return True

    def evict(self, namespace: str, name: str):
        self.calls.append(("evict", name))
        return "evicted"

    def apply_status(self, obj: dict, field_manager: str):
        """Server-side apply as the API server does it for these fields: scalars replaced, conditions
        merged by type (the list-map key), the resourceVersion moved."""
        self.calls.append(("apply-status", field_manager))
        status = self.fleet.setdefault("status", {})
        for key, value in obj["status"].items():
            if key == "conditions":
                applied = {c["type"]: c for c in value}
                kept = [c for c in status.get("conditions") or [] if c["type"] not in applied]
                status["conditions"] = kept + list(applied.values())
            else:
                status[key] = value
        self.fleet["metadata"]["resourceVersion"] = str(int(self.fleet["metadata"]["resourceVersion"]) + 1)
        return copy.deepcopy(self.fleet)


def cluster_at_rest(body: dict) -> dict:
    """kind -> {(namespace, fleet): objects}: every child as applied, the gateway ready, the
    proxies created from the current template and Ready."""
    fleet = parse_fleet(body)
    indexes: dict = {kind: {} for kind in CACHED_KINDS}

    def add(obj: dict) -> None:
        for key, value in by_fleet(obj).items():
            indexes[(obj["apiVersion"], obj["kind"])].setdefault(key, []).append(value)

    for manifest in desired_children(fleet):
        stored = with_desired_hash(manifest)
        if stored["kind"] == "Deployment":
            stored["status"] = {"readyReplicas": stored["spec"]["replicas"]}
        add(stored)
    for ordinal in range(fleet.proxy.replicas):
        add({**proxy_pod(fleet, ordinal), "status": READY})
    return indexes


def reconciler_for(body: dict, indexes: dict | None = None) -> tuple[Reconciler, RecordingApi, dict]:
    api = RecordingApi(body)
    fleets = FleetStore()
    fleets.put(api.fleet)
    indexes = indexes if indexes is not None else cluster_at_rest(body)
    return Reconciler(api, fleets, OwnedObjects(indexes)), api, indexes  # type: ignore[arg-type]


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
