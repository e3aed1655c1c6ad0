"""The operator's Helm chart: helm lint, helm template in both RBAC modes, least privilege, CRDs in sync."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest
import yaml
from rolloutfleet_operator.fleet import NetworkPolicySpec
from rolloutfleet_testkit.controlplane.build import binaries_dir

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "rolloutfleet-operator"


@pytest.fixture(scope="module")
def helm() -> str:
    built = binaries_dir() / "helm"
    found = str(built) if built.exists() else shutil.which("helm")
    assert found, "helm not found: run `./dev cluster build` (./dev test does) or put helm on PATH"
    return found


def render_result(helm: str, *values: str, flags: Sequence[str] = ()) -> subprocess.CompletedProcess:
    """`helm template` with `--set` for each of `values`, plus other helm `flags` (e.g. --api-versions)."""
    args = [helm, "template", "fleet", str(CHART), "--namespace", "ops", "--kube-version", "1.35.4", *flags]
    for value in values:
        args += ["--set", value]
    return subprocess.run(args, capture_output=True, text=True)


def render(helm: str, *values: str, flags: Sequence[str] = ()) -> list[dict]:
    result = render_result(helm, *values, flags=flags)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def rules(docs: list[dict], kind: str) -> list[dict]:
    return [rule for doc in docs if doc["kind"] == kind for rule in doc.get("rules", [])]


def test_helm_lint(helm):
    result = subprocess.run([helm, "lint", str(CHART)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_chart_installs_and_upgrades_the_project_crd_and_keeps_it_on_uninstall(helm):
    project = yaml.safe_load((ROOT / "crds" / "rolloutfleets.rolloutfleet.dev.yaml").read_text())
    crds = [doc for doc in render(helm) if doc["kind"] == "CustomResourceDefinition"]
    assert crds == [project]  # a template (upgraded by helm upgrade), not the chart's crds/ folder
    assert project["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert not (CHART / "crds").exists()
    apart = render(helm, "crds.install=false")
    assert not [doc for doc in apart if doc["kind"] == "CustomResourceDefinition"]


def leader_election_role(docs: list[dict]) -> dict | None:
    return next(
        (d for d in docs if d["kind"] == "Role" and d["metadata"]["name"].endswith("-leader-election")), None
    )


def test_cluster_wide_mode(helm):
    docs = render(helm)
    kinds = sorted(doc["kind"] for doc in docs)
    # The only Role: leader election's, on Leases in the release namespace.
    assert kinds.count("ClusterRole") == 2 and kinds.count("Role") == 1
    assert leader_election_role(docs)["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create", "update"]}
    ]
    deployment = next(doc for doc in docs if doc["kind"] == "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--all-namespaces" in args and "--log-level=info" in args and "--metrics-port=8080" in args


def test_namespaced_mode_grants_nothing_cluster_wide_but_crd_reading(helm):
    docs = render(helm, "watchNamespaces={team-a,team-b}", "logLevel=debug")
    roles = [doc for doc in docs if doc["kind"] == "Role" and doc is not leader_election_role(docs)]
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


def test_replicas_above_one_run_with_leader_election_only(helm):
    docs = render(helm, "replicaCount=3")
    deployment = next(doc for doc in docs if doc["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert deployment["spec"]["replicas"] == 3 and deployment["spec"]["strategy"] == {"type": "RollingUpdate"}
    assert "--leader-election" in container["args"]
    assert {e["name"] for e in container["env"]} >= {"POD_NAME", "POD_NAMESPACE"}
    single = render(helm, "leaderElection.enabled=false")
    deployment = next(doc for doc in single if doc["kind"] == "Deployment")
    assert deployment["spec"]["strategy"] == {"type": "Recreate"} and leader_election_role(single) is None
    assert "--leader-election" not in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    refused = render_result(helm, "replicaCount=2", "leaderElection.enabled=false")
    assert refused.returncode != 0 and "needs leaderElection.enabled" in refused.stderr


def test_network_policy_and_gateway_image_values_reach_the_operators_environment(helm):
    docs = render(
        helm,
        "networkPolicy.enabled=true",
        "networkPolicy.clients.matchLabels.role=rollout-worker",
        "fleetDefaults.gatewayImage=registry.example/router:0.3.2",
    )
    deployment = next(doc for doc in docs if doc["kind"] == "Deployment")
    env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["ROLLOUTFLEET_DEFAULT_GATEWAY_IMAGE"] == "registry.example/router:0.3.2"
    policy = NetworkPolicySpec.parse(env["ROLLOUTFLEET_NETWORK_POLICY"])  # what the operator reads
    assert policy.clients == {"matchLabels": {"role": "rollout-worker"}}
    assert policy.operator_namespace == "ops" and policy.client_namespaces is None and policy.scrapers is None
    off = next(doc for doc in render(helm) if doc["kind"] == "Deployment")
    names = {e["name"] for e in off["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "ROLLOUTFLEET_NETWORK_POLICY" not in names and "ROLLOUTFLEET_DEFAULT_GATEWAY_IMAGE" not in names
