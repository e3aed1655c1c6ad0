"""The operator's chart installed with helm into a real cluster: its ServiceAccount can do what the
operator needs and nothing more (`kubectl auth can-i --as`)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

CHART = Path(__file__).resolve().parents[2] / "charts" / "rolloutfleet-operator"


def can(cluster, verb: str, resource: str, namespace: str, who: str) -> bool:
    result = cluster.kubectl("auth", "can-i", verb, resource, "-n", namespace, f"--as={who}", check=False)
    return result.stdout.strip() == "yes"


def test_namespaced_install_is_least_privilege(cluster, namespace):
    watched = namespace
    install = subprocess.run(
        [
            cluster.tool("helm"),
            "--kubeconfig",
            cluster.kubeconfig,
            "install",
            "rbac-check",
            str(CHART),
            "--namespace",
            namespace,
            "--set",
            "replicaCount=0",
            "--set",
            f"watchNamespaces={{{watched}}}",
            "--wait",
            "--timeout",
            "60s",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert install.returncode == 0, install.stderr
    try:
        who = f"system:serviceaccount:{namespace}:rbac-check-rolloutfleet-operator"
        allowed = [
            ("create", "pods"),
            ("delete", "pods"),
            ("patch", "rolloutfleets.rolloutfleet.dev/status"),
            ("watch", "rolloutfleets.rolloutfleet.dev"),
            ("create", "deployments.apps"),
            ("create", "roles.rbac.authorization.k8s.io"),
            ("create", "events"),
            ("create", "secrets"),
        ]
        for verb, resource in allowed:
            assert can(cluster, verb, resource, watched, who), f"{verb} {resource} should be allowed"
        denied = [
            ("list", "secrets", watched),
            ("delete", "rolloutfleets.rolloutfleet.dev", watched),
            ("create", "pods", "default"),
            ("patch", "deployments.apps", "kube-system"),
            ("delete", "nodes", watched),
            ("create", "clusterroles.rbac.authorization.k8s.io", watched),
        ]
        for verb, resource, where in denied:
            assert not can(cluster, verb, resource, where, who), (
                f"{verb} {resource} in {where} should be denied"
            )
    finally:
        subprocess.run(
            [
                cluster.tool("helm"),
                "--kubeconfig",
                cluster.kubeconfig,
                "uninstall",
                "rbac-check",
                "--namespace",
                namespace,
            ],
            capture_output=True,
            timeout=120,
        )
