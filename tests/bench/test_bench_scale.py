"""The scale benchmark's pure parts (bench/scale.py): its arguments, the fleets it applies, when
fleets count as Ready, and the summaries of readiness and the operator's usage. The run itself on
KWOK: e2e/tests/test_kwok_scale.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def scale(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # the benchmarks import their shared `common` module
    import scale

    return scale


def test_defaults_are_the_issues_size_and_small_runs_parse(scale):
    args = scale.parse_args([])
    assert (args.fleets, args.proxies, args.nodes) == (100, 16, 20)
    assert args.api_qps is None and args.api_burst is None  # the operator's own defaults
    small = scale.parse_args(["--fleets", "5", "--proxies", "4", "--nodes", "2", "--window-s", "30"])
    assert (small.fleets, small.proxies, small.nodes, small.window_s) == (5, 4, 2, 30.0)


@pytest.mark.parametrize(
    "argv",
    [
        ["--fleets", "0"],
        ["--proxies", "-1"],
        ["--window-s", "0"],
        ["--settle-s", "-1"],
        ["--fleets", "100", "--proxies", "16", "--nodes", "6"],  # 1,700 pods > 6 x 250
    ],
)
def test_bad_arguments_are_refused(scale, argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        scale.parse_args(argv)
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_fleets_have_external_engines_no_watchdog_and_a_dump_volume(scale):
    fleet = scale.fleet_manifest("sc007", 16)
    assert fleet["metadata"] == {"name": "sc007", "namespace": scale.NAMESPACE}
    spec = fleet["spec"]
    assert spec["proxy"]["replicas"] == 16 and spec["externalEngineUrls"] == [scale.ENGINE_URL]
    assert spec["proxy"]["memory"] == {"rssBudgetBytes": 0}
    assert "hostPath" in spec["proxy"]["dump"]  # a claim that does not exist would keep pods Pending
    assert sorted({scale.fleet_name(i) for i in range(100)})[-1] == "sc099"


def fleet(name: str, ready: int, updated: int, condition: str) -> dict:
    return {
        "metadata": {"name": name},
        "status": {
            "readyReplicas": ready,
            "updatedReplicas": updated,
            "conditions": [{"type": "Ready", "status": condition}],
        },
    }


def test_a_fleet_is_ready_with_all_its_proxies_updated_and_ready_and_its_condition_true(scale):
    items = [
        fleet("a", 4, 4, "True"),
        fleet("b", 3, 4, "True"),
        fleet("c", 4, 4, "False"),
        fleet("d", 4, 3, "True"),
        {"metadata": {"name": "e"}},
    ]
    assert scale.ready_fleets(items, 4) == {"a"}
    assert scale.ready_proxies(items) == 4 + 3 + 4 + 4


def test_ready_summary(scale):
    times = {f"f{i}": float(i) for i in range(1, 11)}
    summary = scale.ready_summary(times, 10)
    assert summary == {
        "fleets_ready": 10,
        "first_s": 1.0,
        "median_s": 5.5,
        "p90_s": 9.0,
        "all_ready_s": 10.0,
    }
    assert scale.ready_summary(times, 11)["all_ready_s"] is None  # one never got there
    assert scale.ready_summary({}, 3)["first_s"] is None


def test_usage_is_peak_and_last_rss_and_cpu_seconds_per_second(scale):
    rows = [(0.0, 100 * 2**20, 1.0), (1.0, 300 * 2**20, 1.5), (4.0, 200 * 2**20, 3.0)]
    assert scale.usage(rows) == {
        "seconds": 4.0,
        "rss_peak_mib": 300.0,
        "rss_last_mib": 200.0,
        "cpu_cores": 0.5,
        "cpu_seconds": 2.0,
    }
    assert scale.usage(rows[:1]) == {}
    assert scale.per_minute(30, 120) == 15.0


def test_the_operator_authenticates_with_its_token_against_the_same_server(scale):
    admin = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "local", "cluster": {"server": "https://127.0.0.1:6443"}}],
        "users": [{"name": "admin", "user": {"client-certificate": "a.crt", "client-key": "a.key"}}],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": "admin"}}],
        "current-context": "local",
    }
    config = json.loads(scale.token_kubeconfig(json.dumps(admin), "t0ken"))
    assert config["users"] == [{"name": "admin", "user": {"token": "t0ken"}}]
    assert config["clusters"] == admin["clusters"] and config["current-context"] == "local"
