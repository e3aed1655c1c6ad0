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
