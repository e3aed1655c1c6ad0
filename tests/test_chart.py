"""The operator's Helm chart: helm lint, helm template in both RBAC modes, least privilege, CRDs in sync."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest
import yaml
from rolloutfleet_testkit.controlplane.build import binaries_dir

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "rolloutfleet-operator"


@pytest.fixture(scope="module")
def helm() -> str:
    built = binaries_dir() / "helm"
    found = str(built) if built.exists() else shutil.which("helm")
    assert found, "helm not found: run `./dev cluster build` (./dev test does) or put helm on PATH"
    return found


def render(helm: str, *values: str, flags: Sequence[str] = ()) -> list[dict]:
    """`helm template` with `--set` for each of `values`, plus other helm `flags` (e.g. --api-versions)."""
    args = [helm, "template", "fleet", str(CHART), "--namespace", "ops", "--kube-version", "1.35.4", *flags]
    for value in values:
        args += ["--set", value]
    result = subprocess.run(args, capture_output=True, text=True, check=True)
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def rules(docs: list[dict], kind: str) -> list[dict]:
    return [rule for doc in docs if doc["kind"] == kind for rule in doc.get("rules", [])]


def test_helm_lint(helm):
    result = subprocess.run([helm, "lint", str(CHART)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_chart_crds_are_the_project_crds():
    assert (CHART / "crds" / "rolloutfleets.rolloutfleet.dev.yaml").read_text() == (
        ROOT / "crds" / "rolloutfleets.rolloutfleet.dev.yaml"
    ).read_text()


def test_cluster_wide_mode(helm):
    docs = render(helm)
    kinds = sorted(doc["kind"] for doc in docs)
    assert kinds.count("ClusterRole") == 2 and "Role" not in kinds
    deployment = next(doc for doc in docs if doc["kind"] == "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--all-namespaces" in args and "--log-level=info" in args and "--metrics-port=8080" in args


def test_namespaced_mode_grants_nothing_cluster_wide_but_crd_reading(helm):
    docs = render(helm, "watchNamespaces={team-a,team-b}", "logLevel=debug")
    roles = [doc for doc in docs if doc["kind"] == "Role"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    cluster_rules = rules(docs, "ClusterRole")
    assert cluster_rules == [
        {
            "apiGroups": ["apiextensions.k8s.io"],
            "resources": ["customresourcedefinitions"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    deployment = next(doc for doc in docs if doc["kind"] == "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args and "--all-namespaces" not in args


@pytest.mark.parametrize("values", [(), ("watchNamespaces={team-a}",)])
def test_least_privilege(helm, values):
    docs = render(helm, *values)
    for rule in rules(docs, "ClusterRole") + rules(docs, "Role"):
        assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
        if "secrets" in rule["resources"]:
            assert sorted(rule["verbs"]) == ["create", "get"]  # its own admin-key Secrets, never list/watch
        if "pods" in rule["resources"]:
            assert "deletecollection" not in rule["verbs"]
    assert not any("nodes" in rule["resources"] for rule in rules(docs, "ClusterRole"))


def test_values_reach_the_deployment(helm):
    docs = render(
        helm,
        "image.repository=registry.example/rf-operator",
        "image.tag=1.2.3",
        "replicaCount=0",
        "resources.limits.memory=1Gi",
    )
    deployment = next(doc for doc in docs if doc["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "registry.example/rf-operator:1.2.3" and deployment["spec"]["replicas"] == 0
    assert container["resources"]["limits"]["memory"] == "1Gi"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
