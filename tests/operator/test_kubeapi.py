"""REST paths of the kinds the operator manages (pure)."""

from __future__ import annotations

import pytest
from rolloutfleet_operator.kubeapi import object_path, resource_path


@pytest.mark.parametrize(
    ("api_version", "kind", "name", "expected"),
    [
        ("v1", "Pod", "p", "/api/v1/namespaces/ns/pods/p"),
        ("v1", "Service", None, "/api/v1/namespaces/ns/services"),
        ("apps/v1", "Deployment", "d", "/apis/apps/v1/namespaces/ns/deployments/d"),
        (
            "rbac.authorization.k8s.io/v1",
            "RoleBinding",
            "b",
            "/apis/rbac.authorization.k8s.io/v1/namespaces/ns/rolebindings/b",
        ),
        (
            "rolloutfleet.dev/v1alpha1",
            "RolloutFleet",
            "f",
            "/apis/rolloutfleet.dev/v1alpha1/namespaces/ns/rolloutfleets/f",
        ),
    ],
)
def test_resource_paths(api_version, kind, name, expected):
    assert resource_path(api_version, kind, "ns", name) == expected


def test_object_path_and_unknown_kinds():
    assert (
        object_path({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s", "namespace": "n"}})
        == "/api/v1/namespaces/n/secrets/s"
    )
    with pytest.raises(KeyError):
        resource_path("v1", "Node", "ns", "x")  # cluster-scoped kinds are not the operator's business
