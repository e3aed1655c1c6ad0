"""Server-side apply through the operator's API layer against a real API server: applying the same
manifest twice changes nothing, and a changed field is updated in place."""

from __future__ import annotations

import pytest
from rolloutfleet_operator.kubeapi import KubeApi, load_configuration

pytestmark = pytest.mark.e2e


def test_apply_is_idempotent(cluster, namespace):
    api = KubeApi(load_configuration(cluster.kubeconfig))
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "applied", "namespace": namespace, "labels": {"a": "1"}},
        "spec": {"selector": {"app": "x"}, "ports": [{"name": "http", "port": 80}]},
    }
    first = api.apply(service)
    second = api.apply(service)
    assert first["metadata"]["resourceVersion"] == second["metadata"]["resourceVersion"]  # no write at all
    changed = api.apply({**service, "metadata": {**service["metadata"], "labels": {"a": "2"}}})
    assert changed["metadata"]["labels"]["a"] == "2"
    assert [s["metadata"]["name"] for s in api.list("v1", "Service", namespace, "a=2")] == ["applied"]
    assert api.delete("/api/v1/namespaces/" + namespace + "/services/applied") is True
    assert api.get("/api/v1/namespaces/" + namespace + "/services/applied") is None
    api.close()


def test_evict_honours_the_pod_disruption_budget(cluster, namespace):
    """The operator's rolls and memory restarts evict: refused (429) while the budget allows no
    disruption, done once it does, never to a pod of another uid; a pod that is gone is reported as
    such."""
    from rolloutfleet_testkit.waiting import wait_for

    api = KubeApi(load_configuration(cluster.kubeconfig))
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "evictee", "namespace": namespace, "labels": {"app": "evictee"}},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "main", "image": "busybox:1.36", "command": ["sleep", "600"]}],
        },
    }
    budget = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": "evictee", "namespace": namespace},
        # minAvailable: a bare pod has no controller to count expected pods from (maxUnavailable
        # needs one; the proxies' is their RolloutFleet, through its scale subresource).
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "evictee"}}},
    }
    bystander = {**pod, "metadata": {"name": "bystander", "namespace": namespace}}
    api.apply(pod)
    api.apply(budget)
    api.apply(bystander)
    cluster.kubectl("wait", "--for=condition=Ready", "pod/evictee", "-n", namespace, "--timeout=120s")
    # With a uid that is not the pod's (its name taken by a replacement meanwhile): not evicted.
    # (A pod under a budget would have the budget's disruption spent first, for up to 2 minutes.)
    assert api.evict(namespace, "bystander", "not-its-uid") == "gone"
    assert (
        api.get(f"/api/v1/namespaces/{namespace}/pods/bystander")["metadata"].get("deletionTimestamp") is None
    )
    path = f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets/evictee"

    def budget_status(allowed: int) -> bool:
        status = (api.get(path) or {}).get("status", {})
        return status.get("currentHealthy") == 1 and status.get("disruptionsAllowed") == allowed

    wait_for(lambda: budget_status(0), what="the budget's status (no disruption allowed)")
    assert api.evict(namespace, "evictee") == "refused"
    api.apply({**budget, "spec": {**budget["spec"], "minAvailable": 0}})
    wait_for(lambda: budget_status(1), what="the budget's status (one disruption allowed)")
    uid = api.get(f"/api/v1/namespaces/{namespace}/pods/evictee")["metadata"]["uid"]
    assert api.evict(namespace, "evictee", uid) == "evicted"
    assert api.evict(namespace, "no-such-pod") == "gone"
    api.close()


def test_two_status_writers_apply_their_own_conditions_without_erasing_each_other(cluster, namespace):
    """The reconciler and the memory watchdog apply the fleet's status under their own field
    managers, without reading first: the API server merges the conditions by type (the CRD's
    list-map), so neither erases the other's, and one giving up a field removes only its own."""
    from rolloutfleet_operator.status_apply import RECONCILER_MANAGER, WATCHDOG_MANAGER, status_patch
    from rolloutfleet_testkit import fleet_setup

    cluster.kubectl("apply", "-f", str(fleet_setup.CRDS))
    cluster.kubectl_client().wait_established("rolloutfleets.rolloutfleet.dev")
    api = KubeApi(load_configuration(cluster.kubeconfig))
    fleet = fleet_setup.external_fleet("ssa", namespace, "/tmp", "http://e:1", replicas=1)
    api.create(f"/apis/rolloutfleet.dev/v1alpha1/namespaces/{namespace}/rolloutfleets", fleet)

    def condition(type_: str, status: str) -> dict:
        return {
            "type": type_,
            "status": status,
            "reason": "Test",
            "message": "",
            "lastTransitionTime": "2026-01-01T00:00:00Z",
        }

    reconciler = {
        "readyReplicas": 1,
        "conditions": [condition("Ready", "True"), condition("Available", "True")],
    }
    watchdog = {"memoryRestarts": {"total": 1}, "conditions": [condition("MemoryPressure", "False")]}
    api.apply_status(status_patch(namespace, "ssa", reconciler), RECONCILER_MANAGER)
    stored = api.apply_status(status_patch(namespace, "ssa", watchdog), WATCHDOG_MANAGER)
    assert stored is not None
    assert {c["type"] for c in stored["status"]["conditions"]} == {"Ready", "Available", "MemoryPressure"}
    # The reconciler again, from a view without the watchdog's fields: they stay.
    again = {**reconciler, "conditions": [condition("Ready", "False"), condition("Available", "True")]}
    stored = api.apply_status(status_patch(namespace, "ssa", again), RECONCILER_MANAGER)
    assert stored is not None
    by_type = {c["type"]: c["status"] for c in stored["status"]["conditions"]}
    assert by_type == {"Ready": "False", "Available": "True", "MemoryPressure": "False"}
    assert stored["status"]["memoryRestarts"] == {"total": 1}
    # A condition the reconciler no longer applies is removed; the watchdog's stays.
    fewer = {**reconciler, "conditions": [condition("Ready", "False")]}
    stored = api.apply_status(status_patch(namespace, "ssa", fewer), RECONCILER_MANAGER)
    assert stored is not None
    assert {c["type"] for c in stored["status"]["conditions"]} == {"Ready", "MemoryPressure"}
    managers = {m["manager"] for m in stored["metadata"]["managedFields"] if m.get("subresource") == "status"}
    assert managers == {RECONCILER_MANAGER, WATCHDOG_MANAGER}
    assert api.apply_status(status_patch(namespace, "gone", fewer), RECONCILER_MANAGER) is None
    api.close()
