"""The scale benchmark's smoke run (bench/scale.py at 5 fleets x 4 proxies): KWOK's simulated nodes
on the local control plane, the real operator under its chart's ServiceAccount, requests counted in
the API server's audit log. It starts its own control plane (not the suite's real nodes), about
100 s on the 2-core machine; run it under the machine-wide cluster lock like every e2e test."""

from __future__ import annotations

from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
FLEETS, PROXIES, NODES = 5, 4, 2
RESYNC_S = 10  # the operator's periodic pass (main.RESYNC_SECONDS)

pytestmark = pytest.mark.e2e


def test_fleets_on_simulated_nodes_become_ready_and_rest_quietly(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import scale
    from rolloutfleet_testkit.controlplane import kwok

    args = scale.parse_args(
        [
            *("--fleets", str(FLEETS), "--proxies", str(PROXIES), "--nodes", str(NODES)),
            *("--window-s", "30", "--settle-s", "15", "--timeout-s", "180"),
        ]
    )
    with kwok.simulated_cluster(tmp_path, nodes=NODES) as cluster:
        result = scale.run(cluster, tmp_path, args)
        pods = cluster.kubectl(scale.NAMESPACE).json("pods", "-l", "app.kubernetes.io/component=proxy")
        assert len(pods["items"]) == FLEETS * PROXIES
        # Scheduled onto KWOK's nodes and made Running and Ready there, with no kubelet.
        assert {p["spec"]["nodeName"] for p in pods["items"]} <= set(cluster.nodes)
        assert {p["status"]["phase"] for p in pods["items"]} == {"Running"}
        assert kwok.ready_nodes(cluster.kubectl().json("nodes")) == cluster.nodes

    ready = result["apply_to_ready"]
    assert ready["fleets_ready"] == FLEETS and ready["all_ready_s"] is not None
    assert ready["requests"] > 0 and ready["by_verb_and_resource"]["create pods"] == FLEETS * PROXIES
    at_rest = result["at_rest"]
    assert at_rest["writes"] == 0, at_rest["by_verb_and_resource"]
    per_resync = at_rest["requests"] / FLEETS / (at_rest["window_s"] / RESYNC_S)
    assert per_resync <= 2, at_rest["by_verb_and_resource"]
    assert at_rest["lease_requests"] > 0  # the operator led, and renewed its Lease, all along
    assert at_rest["operator"]["rss_last_mib"] > 0 and at_rest["operator"]["cpu_cores"] >= 0
