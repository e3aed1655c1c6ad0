"""Everything the chart renders, in each of its modes, is accepted by a real API server (a server-side
dry run: schemas, defaulting, admission), the CRD included; the monitoring objects need the
Prometheus Operator's CRDs, which this cluster does not have, so they are checked by
tests/operator/test_chart_monitoring.py (helm template, promtool) instead."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.e2e

CHART = Path(__file__).resolve().parents[2] / "charts" / "rolloutfleet-operator"
MODES = {
    "defaults (cluster-wide, the CRD, leader election)": [],
    "namespaced, three replicas": ["watchNamespaces={a,b}", "replicaCount=3"],
    "network policies, fleet defaults": [
        "networkPolicy.enabled=true",
        "networkPolicy.scrapeNamespaces.matchLabels.team=monitoring",
        "fleetDefaults.gatewayImage=registry.example/rolloutfleet-sglang-router:0.3.2",
    ],
    "no leader election, CRD managed apart": ["leaderElection.enabled=false", "crds.install=false"],
    "the dashboard (a ConfigMap)": ["monitoring.enabled=true", "monitoring.dashboard.enabled=true"],
}


@pytest.mark.parametrize("values", MODES.values(), ids=MODES.keys())
def test_everything_rendered_passes_a_server_side_dry_run(cluster, namespace, values):
    args = [cluster.tool("helm"), "template", "dry", str(CHART), "--namespace", namespace]
    args += ["--kube-version", "1.35.4"]
    for value in values:
        args += ["--set", value]
    rendered = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert rendered.returncode == 0, rendered.stderr
    documents = [doc for doc in yaml.safe_load_all(rendered.stdout) if doc]
    assert {"Deployment", "ServiceAccount", "Service"} <= {doc["kind"] for doc in documents}
    # Namespaced objects go to the test's namespace; the two watched namespaces of the namespaced
    # mode exist only there, so their Roles are checked in the release's namespace instead.
    for doc in documents:
        if doc["metadata"].get("namespace") not in (None, namespace):
            doc["metadata"]["namespace"] = namespace
    listing = json.dumps({"apiVersion": "v1", "kind": "List", "items": documents})
    result = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=listing, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("(server dry run)") == len(documents), result.stdout
