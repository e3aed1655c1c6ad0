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
