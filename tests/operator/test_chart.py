"""The operator's Helm chart: helm lint, helm template in both RBAC modes, least privilege, CRDs in sync."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest
import rolloutfleet_proxy
import yaml
from rolloutfleet_operator.fleet import (
    GATEWAY_IMAGE_ENV,
    PROXY_IMAGE_ENV,
    SGLANG_ROUTER_VERSION,
    NetworkPolicySpec,
    OperatorDefaults,
    package_version,
)
from rolloutfleet_testkit.controlplane.build import ensure_helm
from rolloutfleet_testkit.images.catalog import image_name
from rolloutfleet_testkit.version import chart_versions, project_version, set_version

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "rolloutfleet-operator"


@pytest.fixture(scope="module")
def helm() -> str:
    return str(ensure_helm())  # the pinned helm; waits while ./dev test's background prepare builds it


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


NODE_READING = {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}


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
    assert kinds.count("ClusterRole") == 3 and kinds.count("Role") == 1
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
        },
        NODE_READING,
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
    # Nodes: `get` only, to tell whether a proxy stuck terminating is on a lost node.
    assert [rule for rule in rules(docs, "ClusterRole") if "nodes" in rule["resources"]] == [NODE_READING]
    bindings = {d["roleRef"]["name"] for d in docs if d["kind"] == "ClusterRoleBinding"}
    assert any(name.endswith("-node-reader") for name in bindings)


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


# --- images, registry and the one version ------------------------------------------------------------


def operator_pod(docs: list[dict]) -> dict:
    return next(doc for doc in docs if doc["kind"] == "Deployment")["spec"]["template"]


def operator_env(pod: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}


def test_one_version_the_package_the_chart_the_proxy_and_the_images():
    version = project_version((ROOT / "pyproject.toml").read_text())
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert (chart["version"], chart["appVersion"]) == (version, version), "run ./dev version " + version
    assert rolloutfleet_proxy.__version__ == package_version() == version  # the installed metadata
    assert image_name("proxy") == f"rolloutfleet-proxy:{version}"
    assert image_name("operator") == f"rolloutfleet-operator:{version}"


def test_without_a_registry_the_images_are_local_names_of_this_version(helm):
    pod = operator_pod(render(helm))
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert pod["spec"]["containers"][0]["image"] == f"rolloutfleet-operator:{version}"
    env = operator_env(pod)
    assert env[PROXY_IMAGE_ENV] == f"rolloutfleet-proxy:{version}" and GATEWAY_IMAGE_ENV not in env
    # What the operator makes of that environment: the same as with none (its own fallbacks).
    assert OperatorDefaults.from_environment(env, version) == OperatorDefaults.from_environment({}, version)


def test_the_registry_and_tag_name_every_image(helm):
    pod = operator_pod(render(helm, "image.registry=ghcr.io/acme/", "image.tag=2.0.0-rc.1"))
    assert pod["spec"]["containers"][0]["image"] == "ghcr.io/acme/rolloutfleet-operator:2.0.0-rc.1"
    defaults = OperatorDefaults.from_environment(operator_env(pod), "ignored")
    assert defaults.proxy_image == "ghcr.io/acme/rolloutfleet-proxy:2.0.0-rc.1"
    # The router image keeps the router's own version (the operator's default, tagged by it).
    assert defaults.gateway_image == f"ghcr.io/acme/rolloutfleet-sglang-router:{SGLANG_ROUTER_VERSION}"
    pinned = operator_pod(
        render(helm, "image.registry=r.example", "fleetDefaults.proxyImage=r.example/proxy@sha256:ab")
    )
    assert operator_env(pinned)[PROXY_IMAGE_ENV] == "r.example/proxy@sha256:ab"


def test_pod_values_are_rendered_not_dropped(helm):
    default = operator_pod(render(helm))
    for key in ("imagePullSecrets", "affinity", "priorityClassName"):
        assert key not in default["spec"], key
    assert "annotations" not in default["metadata"]
    affinity = "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0]"
    pod = operator_pod(
        render(
            helm,
            "imagePullSecrets[0].name=regcred",
            f"{affinity}.matchExpressions[0].key=pool",
            f"{affinity}.matchExpressions[0].operator=Exists",
            "priorityClassName=system-cluster-critical",
            "podAnnotations.example\\.com/owner=rl",
            "podLabels.team=rl",
        )
    )
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"] == [{"matchExpressions": [{"key": "pool", "operator": "Exists"}]}]
    assert pod["spec"]["priorityClassName"] == "system-cluster-critical"
    assert pod["metadata"]["annotations"] == {"example.com/owner": "rl"}
    assert pod["metadata"]["labels"]["team"] == "rl"
    assert pod["metadata"]["labels"]["app.kubernetes.io/name"] == "rolloutfleet-operator"  # selector kept


def test_a_version_bump_rewrites_the_version_lines_only(tmp_path):
    pyproject, chart = tmp_path / "pyproject.toml", tmp_path / "Chart.yaml"
    pyproject.write_text((ROOT / "pyproject.toml").read_text())
    chart.write_text((CHART / "Chart.yaml").read_text())
    set_version("1.4.0-rc.2", pyproject, chart)
    assert project_version(pyproject.read_text()) == "1.4.0-rc.2"
    assert chart_versions(chart.read_text()) == ("1.4.0-rc.2", "1.4.0-rc.2")
    assert yaml.safe_load(chart.read_text())["appVersion"] == "1.4.0-rc.2"
    # Nothing else moved: the dependency pins (also "version"-like lines) and the chart's other keys.
    before = (ROOT / "pyproject.toml").read_text().splitlines()
    changed = [
        pair for pair in zip(before, pyproject.read_text().splitlines(), strict=True) if pair[0] != pair[1]
    ]
    assert len(changed) == 1 and changed[0][1] == 'version = "1.4.0-rc.2"'
    assert (
        yaml.safe_load(chart.read_text())["kubeVersion"]
        == yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]
    )
    for bad in ("1.4", "v1.4.0", "1.4.0+build.1"):  # not an image tag, or not SemVer
        with pytest.raises(ValueError):
            set_version(bad, pyproject, chart)


def test_the_install_notes_name_instructions_that_exist(helm, tmp_path):
    # helm template leaves NOTES.txt out: render it as a template of a copy of the chart.
    copy = tmp_path / "chart"
    shutil.copytree(CHART, copy)
    body = (copy / "templates" / "NOTES.txt").read_text()
    (copy / "templates" / "NOTES.txt").unlink()
    (copy / "templates" / "notes.yaml").write_text(
        '{{- define "notes" -}}\n' + body + '{{- end -}}\nnotes: {{ include "notes" . | toJson }}\n'
    )

    def notes(*values: str) -> str:
        args = [
            helm,
            "template",
            "n",
            str(copy),
            "--kube-version",
            "1.35.4",
            "--show-only",
            "templates/notes.yaml",
        ]
        for value in values:
            args += ["--set", value]
        result = subprocess.run(args, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        return yaml.safe_load(result.stdout)["notes"]

    local, pushed = notes(), notes("image.registry=ghcr.io/acme")
    named = set(re.findall(r"\b((?:operator/samples|docs)/[\w./-]+\.(?:yaml|md))", local))
    assert {"operator/samples/minimal.yaml", "docs/release.md", "docs/deploying.md"} <= named
    assert all((ROOT / path).exists() for path in named), named
    assert "image.registry is empty" in local and "image.registry is empty" not in pushed
    assert "ghcr.io/acme/rolloutfleet-proxy:" in pushed
