"""kube-score (the Kubernetes manifest linter, built from the Go module proxy) over what users get:
the chart as rendered and every child the operator builds for the samples, with and without the
operator's NetworkPolicies. Every critical finding is either fixed or accepted below with its reason;
a new one fails the test, and so does an accepted one that no longer occurs (the list stays true)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import test_chart
import yaml
from rolloutfleet_operator.fleet import NETWORK_POLICY_ENV, OperatorDefaults, parse_fleet
from rolloutfleet_operator.manifests.children import desired_children
from rolloutfleet_operator.manifests.proxy_pod import proxy_pod
from rolloutfleet_testkit.controlplane.build import ensure_kube_score
from test_chart import render_result

ROOT = Path(__file__).resolve().parents[2]
CRITICAL = 1  # kube-score's grades: 1 critical, 5 warning, 7 almost OK, 10 OK

# (component, kube-score check) → why it is accepted. Component "*" is every workload.
ACCEPTED = {
    ("*", "container-image-pull-policy"): "IfNotPresent with versioned tags is the norm; Always adds a "
    "registry round trip to every pod start (and fails when the registry is down)",
    ("*", "container-ephemeral-storage-request-and-limit"): "left to users' resources: the proxies' "
    "dumps are on their own volume, and a limit would evict pods writing logs",
    ("*", "container-resources"): "no CPU limit by design (throttling adds latency to every turn); "
    "the samples set memory limits where they size a workload (proxies), others are the user's",
    ("operator", "pod-networkpolicy"): "the operator's own pod takes only probes and metrics scrapes",
    ("operator", "pod-probes-identical"): "kopf serves one health endpoint: readiness and liveness use it",
    ("engine", "container-image-tag"): "the sample cannot know the SGLang release users run "
    "(engines.image is required; the sample's comment says to pin it)",
    ("engine", "container-security-context-user-group-id"): "GPU images (lmsysorg/sglang) run as "
    "root: engines meet Pod Security baseline by default, restricted when the user sets it",
    ("engine", "container-security-context-readonlyrootfilesystem"): "SGLang writes caches under "
    "$HOME and /tmp (triton, torch compile)",
    ("engine", "pod-probes-identical"): "SGLang has one cheap health route (/health with generation off)",
    ("router", "container-security-context-readonlyrootfilesystem"): "the router image is "
    "replaceable by upstream ones; gateway.securityContext can add it",
}
# Without the operator's NetworkPolicies (the default), no fleet pod has one.
ACCEPTED_WITHOUT_POLICIES = {
    (component, "pod-networkpolicy"): "NetworkPolicies are optional (chart networkPolicy.enabled)"
    for component in ("proxy", "router", "engine")
}
WITH_POLICIES = OperatorDefaults.from_environment(
    {NETWORK_POLICY_ENV: json.dumps({"operatorNamespace": "rolloutfleet-system"})}, "0.0.0"
)


def sample_children(name: str, defaults: OperatorDefaults | None) -> list[dict[str, Any]]:
    obj = yaml.safe_load((ROOT / "operator" / "samples" / f"{name}.yaml").read_text())
    obj["metadata"].update({"namespace": "rl", "uid": "00000000-0000-0000-0000-000000000001"})
    fleet = parse_fleet(obj, defaults)
    pods = [proxy_pod(fleet, i) for i in range(fleet.proxy.replicas)]
    return [*desired_children(fleet), *pods]


def chart_objects(helm: str) -> list[dict[str, Any]]:
    result = render_result(helm, "crds.install=false", "replicaCount=2")
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def critical_findings(objects: Iterable[dict[str, Any]]) -> set[tuple[str, str]]:
    """(component, check id) of every critical finding: the component is the container's name
    (proxy, router, engine, operator), or the pod's when the check is about the pod."""
    text = "\n---\n".join(yaml.safe_dump(obj) for obj in objects)
    result = subprocess.run(
        [str(ensure_kube_score()), "score", "-o", "json", "-"], input=text, capture_output=True, text=True
    )
    assert result.stdout, result.stderr
    findings = set()
    for scored in json.loads(result.stdout):
        containers = _containers(scored)
        for check in scored["checks"]:
            if check["skipped"] or check["grade"] != CRITICAL:
                continue
            named = {c.get("path") for c in check.get("comments") or []} & set(containers)
            for component in named or containers or {scored["object_name"]}:
                findings.add((component, check["check"]["id"]))
    return findings


def _containers(scored: dict[str, Any]) -> set[str]:
    kind = scored["type_meta"]["kind"]
    if kind not in ("Pod", "Deployment"):
        return set()
    component = (scored["object_meta"].get("labels") or {}).get("app.kubernetes.io/component")
    return {"router" if component == "gateway" else component or "operator"}


def unexplained(findings: set[tuple[str, str]], accepted: dict) -> set[tuple[str, str]]:
    return {f for f in findings if f not in accepted and ("*", f[1]) not in accepted}


helm = test_chart.helm  # its fixture (the built helm binary), reused here


def test_the_chart_and_the_samples_children_have_no_unexplained_critical_finding(helm):
    objects = chart_objects(helm) + sample_children("gpu", None) + sample_children("minimal", None)
    findings = critical_findings(objects)
    accepted = {**ACCEPTED, **ACCEPTED_WITHOUT_POLICIES}
    assert not unexplained(findings, accepted), unexplained(findings, accepted)
    # Each accepted finding still occurs (else it is removed from the list).
    occurring = {key for key in accepted if key[0] == "*" and any(f[1] == key[1] for f in findings)}
    occurring |= {key for key in accepted if key in findings}
    assert occurring == set(accepted), set(accepted) - occurring


def test_with_the_operators_network_policies_every_fleet_pod_has_one():
    findings = critical_findings(sample_children("gpu", WITH_POLICIES))
    assert not {f for f in findings if f[1] == "pod-networkpolicy"}, findings
    assert not unexplained(findings, ACCEPTED), unexplained(findings, ACCEPTED)
