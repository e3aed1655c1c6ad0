"""The chart's monitoring (docs/operator.md, "Monitoring"): which objects render in which mode, that the
monitors select what the operator really creates, that every metric the alerts and the dashboard query
is one the code exports (the operator's registry, a real proxy's and a real sglang-router's /metrics),
and that the rules pass promtool's checks and fire on the series they are meant for (promtool test)."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterable
from pathlib import Path

import httpx
import pytest
import test_chart
import yaml
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families
from proxy_harness import play_session, running_proxy
from rolloutfleet_operator import metrics
from rolloutfleet_operator.fleet import FLEET_LABEL, parse_fleet
from rolloutfleet_operator.manifests.gateway import gateway_service
from rolloutfleet_operator.manifests.proxy_pod import proxy_pod
from rolloutfleet_testkit.controlplane.build import ensure_promtool
from rolloutfleet_testkit.processes import ServerProcess, free_port, python_module, wait_until_routed
from test_chart import CHART, ROOT, render

helm = test_chart.helm  # its fixture (the built helm binary), reused here

MONITORING_API = "monitoring.coreos.com/v1"
HAS_API = ("--api-versions", MONITORING_API)
MONITOR_KINDS = ["PodMonitor", "PrometheusRule", "ServiceMonitor", "ServiceMonitor"]
DASHBOARD = CHART / "dashboards" / "rolloutfleet.json"
GPU_SAMPLE = ROOT / "operator" / "samples" / "gpu.yaml"


@pytest.fixture(scope="module")
def promtool() -> str:
    return str(ensure_promtool())  # built from the Go module proxy once, then cached per version


def monitor_kinds(docs: list[dict]) -> list[str]:
    return sorted(d["kind"] for d in docs if d["apiVersion"] == MONITORING_API)


def dashboards(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] == "ConfigMap" and "rolloutfleet.json" in d.get("data", {})]


def one(docs: list[dict], kind: str, name_suffix: str = "") -> dict:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(name_suffix)]
    return found


# --- which objects render ---------------------------------------------------------------------------


@pytest.mark.parametrize("flags", [(), HAS_API], ids=["no API", "API"])
def test_monitoring_off_renders_nothing(helm, flags):
    for values in [(), ("monitoring.dashboard.enabled=true", "monitoring.force=true")]:
        docs = render(helm, *values, flags=flags)
        assert monitor_kinds(docs) == [] and dashboards(docs) == []
        assert {d["kind"] for d in docs} >= {"Deployment", "Service"}  # the chart itself did render


def test_monitoring_on_without_the_api_renders_no_monitors(helm):
    assert monitor_kinds(render(helm, "monitoring.enabled=true")) == []
    # The dashboard is a ConfigMap: it needs no custom API.
    docs = render(helm, "monitoring.enabled=true", "monitoring.dashboard.enabled=true")
    assert monitor_kinds(docs) == [] and len(dashboards(docs)) == 1


@pytest.mark.parametrize(
    "values,flags", [(("monitoring.force=true",), ()), ((), HAS_API)], ids=["forced", "API served"]
)
def test_monitoring_on_renders_every_object(helm, values, flags):
    docs = render(
        helm,
        "monitoring.enabled=true",
        "monitoring.labels.release=prometheus",
        "monitoring.dashboard.enabled=true",
        *values,
        flags=flags,
    )
    assert monitor_kinds(docs) == MONITOR_KINDS
    for doc in docs:
        if doc["apiVersion"] == MONITORING_API:
            assert doc["metadata"]["labels"]["release"] == "prometheus"
            assert doc["metadata"]["namespace"] == "ops"
    (dashboard,) = dashboards(docs)
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["rolloutfleet.json"]) == json.loads(DASHBOARD.read_text())


def test_rules_and_dashboard_can_be_left_out(helm):
    docs = render(helm, "monitoring.enabled=true", "monitoring.force=true", "monitoring.rules.enabled=false")
    assert monitor_kinds(docs) == ["PodMonitor", "ServiceMonitor", "ServiceMonitor"]
    assert dashboards(docs) == []


# --- the monitors select what the operator creates --------------------------------------------------


def sample_fleet():
    body = yaml.safe_load(GPU_SAMPLE.read_text())
    body["metadata"].update(namespace="rl", uid="u", generation=1)
    return parse_fleet(body)


def meta_label(kind: str, label: str) -> str:
    """Prometheus's Kubernetes discovery name of an object label (non-alphanumerics become _)."""
    return f"__meta_kubernetes_{kind}_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", label)


def assert_selects(selector: dict, labels: dict) -> None:
    match = selector["matchLabels"]
    assert match and match.items() <= labels.items(), (match, labels)


def test_monitors_select_the_operators_children(helm):
    docs = render(helm, "monitoring.enabled=true", "monitoring.force=true", "monitoring.interval=15s")
    fleet = sample_fleet()

    pod = proxy_pod(fleet, 0)
    proxies = one(docs, "PodMonitor")["spec"]
    assert_selects(proxies["selector"], pod["metadata"]["labels"])
    (endpoint,) = proxies["podMetricsEndpoints"]
    assert endpoint["port"] in {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
    assert endpoint["path"] == "/metrics" and endpoint["interval"] == "15s"
    assert endpoint["relabelings"] == [
        {"sourceLabels": [meta_label("pod", FLEET_LABEL)], "targetLabel": "fleet"}
    ]

    service = gateway_service(fleet)
    gateways = one(docs, "ServiceMonitor", "-gateways")["spec"]
    assert_selects(gateways["selector"], service["metadata"]["labels"])
    (endpoint,) = gateways["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["relabelings"] == [
        {"sourceLabels": [meta_label("service", FLEET_LABEL)], "targetLabel": "fleet"}
    ]
    # Neither selects the other's objects (nor the engines).
    assert not proxies["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()

    chart_service = one(docs, "Service", "-metrics")
    operator = one(docs, "ServiceMonitor", "-rolloutfleet-operator")["spec"]
    assert_selects(operator["selector"], chart_service["metadata"]["labels"])
    (endpoint,) = operator["endpoints"]
    assert endpoint["port"] in {p["name"] for p in chart_service["spec"]["ports"]}
    # The operator's series carry the fleet's namespace and the proxy's pod: they must win.
    assert endpoint["honorLabels"] is True


@pytest.mark.parametrize(
    "values,expected",
    [((), {"any": True}), (("watchNamespaces={team-a,team-b}",), {"matchNames": ["team-a", "team-b"]})],
)
def test_fleet_monitors_look_where_the_operator_works(helm, values, expected):
    docs = render(helm, "monitoring.enabled=true", "monitoring.force=true", *values)
    assert one(docs, "PodMonitor")["spec"]["namespaceSelector"] == expected
    assert one(docs, "ServiceMonitor", "-gateways")["spec"]["namespaceSelector"] == expected
    assert "namespaceSelector" not in one(docs, "ServiceMonitor", "-rolloutfleet-operator")["spec"]


# --- metric names -----------------------------------------------------------------------------------

PROMQL_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (pure): what is left once strings, label matchers,
    ranges, label lists, function and aggregation names, keywords and numbers are taken out."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for match in re.finditer(r"(?<![\w.$])[A-Za-z_:][A-Za-z0-9_:]*", expr):
        if expr[match.end() :].lstrip().startswith("(") or match.group().lower() in PROMQL_KEYWORDS:
            continue
        names.add(match.group())
    return names


def test_metric_names_finds_exactly_the_metrics():
    expr = (
        "histogram_quantile(0.99, sum by (le, fleet) "
        '(rate(a_bucket{fleet=~"$fleet", x="b_c"}[$__rate_interval])))'
        " > on (namespace) group_left () (0.9 * (b_total offset 5m > bool 1e3)) and c unless d or -inf"
    )
    assert metric_names(expr) == {"a_bucket", "b_total", "c", "d"}


def exposed_names(text: str) -> set[str]:
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def operator_metric_names() -> set[str]:
    """What the operator's /metrics (the default registry) exposes once every labelled metric has a
    series: each gets a throw-away child for the scrape, removed after."""
    probes = []
    for metric in vars(metrics).values():
        if isinstance(metric, MetricWrapperBase):
            values = ["probe"] * len(metric._labelnames)
            metric.labels(*values)
            probes.append((metric, values))
    try:
        return exposed_names(generate_latest(REGISTRY).decode())
    finally:
        for metric, values in probes:
            metric.remove(*values)


@pytest.fixture(scope="module")
def proxy_metric_names(sglang_emulator_url, test_tokenizer_dir, tmp_path_factory) -> set[str]:
    with running_proxy(sglang_emulator_url, test_tokenizer_dir, tmp_path_factory.mktemp("dumps")) as proxy:
        play_session(proxy, turns=1)
        return exposed_names(httpx.get(f"{proxy.url}/metrics").text)


@pytest.fixture(scope="module")
def rendered(helm) -> list[dict]:
    return render(
        helm, "monitoring.enabled=true", "monitoring.force=true", "monitoring.dashboard.enabled=true"
    )


def rule_groups(docs: list[dict]) -> list[dict]:
    return one(docs, "PrometheusRule")["spec"]["groups"]


def alert_rules(docs: list[dict]) -> list[dict]:
    return [rule for group in rule_groups(docs) for rule in group["rules"]]


def dashboard_json(docs: list[dict]) -> dict:
    return json.loads(dashboards(docs)[0]["data"]["rolloutfleet.json"])


def dashboard_queries(dashboard: dict) -> list[str]:
    """Every panel's query, and the templating queries' series selectors (label_values(selector, label))."""
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            match = re.fullmatch(r"label_values\((.*),\s*\w+\)", query["query"])
            assert match, query
            queries.append(match.group(1))
    return queries


def test_alerts_use_only_exported_metrics(rendered, proxy_metric_names):
    used = {name for rule in alert_rules(rendered) for name in metric_names(rule["expr"])}
    assert len(used) >= 15  # the extraction saw the rules
    assert {
        "rolloutfleet_operator_fleet_ready",
        "rolloutfleet_operator_fleet_available",
        "rolloutfleet_proxy_storage_writable",
    } <= used
    exported = operator_metric_names() | proxy_metric_names
    assert not used - exported, f"rules query metrics nobody exports: {sorted(used - exported)}"


GATEWAY_PREFIX = "smg_"  # sglang-router's metrics


def test_dashboard_uses_only_exported_operator_and_proxy_metrics(rendered, proxy_metric_names):
    used = {name for q in dashboard_queries(dashboard_json(rendered)) for name in metric_names(q)}
    ours = {name for name in used if not name.startswith(GATEWAY_PREFIX)}
    assert len(ours) >= 12
    exported = operator_metric_names() | proxy_metric_names
    assert not ours - exported, f"the dashboard queries metrics nobody exports: {sorted(ours - exported)}"


@pytest.mark.router
def test_dashboard_gateway_metrics_are_the_real_routers(
    rendered, sglang_emulator_url, test_tokenizer_dir, tmp_path
):
    used = {
        name
        for q in dashboard_queries(dashboard_json(rendered))
        for name in metric_names(q)
        if name.startswith(GATEWAY_PREFIX)
    }
    assert used  # the request latency panel
    port, metrics_port = free_port(), free_port()
    router_url = f"http://127.0.0.1:{port}"
    args = python_module(
        "sglang_router.launch_router",
        *("--host", "127.0.0.1", "--port", str(port), "--worker-urls", sglang_emulator_url),
        *("--policy", "round_robin", "--log-level", "warn"),
        *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)),
    )
    with ServerProcess(args, tmp_path / "router.log") as router:
        router.wait_ready(f"{router_url}/health", 60)
        wait_until_routed(router_url)
        # Traffic as the fleet makes it: a proxy's turns through the router.
        with running_proxy(router_url, test_tokenizer_dir, tmp_path / "dumps") as proxy:
            play_session(proxy, turns=2)
        exported = exposed_names(httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text)
    assert not used - exported, f"sglang-router does not export {sorted(used - exported)}"


def test_dashboard_has_the_panels_operators_need(rendered):
    dashboard = dashboard_json(rendered)
    titles = {panel["title"] for panel in dashboard["panels"]}
    assert {
        "Proxy RSS vs budget",
        "Memory restarts",
        "Active sessions",
        "Turns per second",
        "Gateway request latency",
        "/stats poll failures",
        "Reconcile duration",
        "Reconcile errors",
        "Storage writable",
    } <= titles
    assert all(panel.get("targets") for panel in dashboard["panels"])
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])


# --- promtool -----------------------------------------------------------------------------------------


def promtool_run(promtool: str, *args: str | Path) -> None:
    result = subprocess.run([promtool, *map(str, args)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def write_rules(path: Path, groups: list[dict]) -> Path:
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    return path


def test_rules_pass_promtool_check(rendered, promtool, tmp_path):
    promtool_run(promtool, "check", "rules", write_rules(tmp_path / "rules.yaml", rule_groups(rendered)))


def test_promtool_check_can_fail(rendered, promtool, tmp_path):
    """The check above means something: a broken expression is refused."""
    groups = rule_groups(rendered)
    groups[0]["rules"][0]["expr"] += " and ("
    path = write_rules(tmp_path / "broken.yaml", groups)
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode != 0


def grafana_to_promql(query: str) -> str:
    """A dashboard query as Prometheus would get it with every fleet selected."""
    return query.replace("$__rate_interval", "5m").replace("$namespace", ".*").replace("$fleet", ".*")


def test_dashboard_queries_pass_promtool_check(rendered, promtool, tmp_path):
    queries = dashboard_queries(dashboard_json(rendered))
    group = {
        "name": "dashboard",
        "rules": [
            {"record": f"rolloutfleet_dashboard_query_{i}", "expr": grafana_to_promql(q)}
            for i, q in enumerate(queries)
        ],
    }
    promtool_run(promtool, "check", "rules", write_rules(tmp_path / "dashboard.yaml", [group]))


# Thresholds for the scenario below, set explicitly so the test does not follow the defaults.
SCENARIO_VALUES = tuple(
    f"monitoring.rules.{key}={value}"
    for key, value in {
        "fleetNotReadyFor": "15m",
        "fleetUnavailableFor": "5m",
        "reconcileErrorsFor": "15m",
        "pollFailureRatio": 0.2,
        "pollFailuresFor": "10m",
        "rssBudgetRatio": 0.9,
        "rssNearBudgetFor": "10m",
        "memoryBackoffFor": "5m",
        "storageUnwritableFor": "5m",
        "writeFailuresWindow": "15m",
        "restoreFailuresAlertSeconds": 3600,
        "exportBacklogTrajectories": 1000,
        "exportBacklogFor": "15m",
        "exportsExpiredWindow": "1h",
        "labels.team": "rl-infra",
    }.items()
)
FLEET = 'namespace="rl", fleet="f"'
GONE = 'namespace="rl", fleet="gone"'  # a deleted fleet: its series stay, nothing works on it
P0 = 'namespace="rl", fleet="f", pod="f-proxy-0"'  # the troubled proxy
P1 = 'namespace="rl", fleet="f", pod="f-proxy-1"'  # a healthy one
SERIES = [
    # operator
    (f"rolloutfleet_operator_fleet_ready{{{FLEET}}}", "0x30"),
    (f"rolloutfleet_operator_fleet_available{{{FLEET}}}", "0x30"),
    (f"rolloutfleet_operator_fleet_available{{{GONE}}}", "0x30"),
    (f"rolloutfleet_operator_reconcile_duration_seconds_count{{{FLEET}}}", "0+6x30"),
    (f"rolloutfleet_operator_fleet_ready{{{GONE}}}", "0x30"),
    (f"rolloutfleet_operator_reconcile_duration_seconds_count{{{GONE}}}", "40x30"),
    (f"rolloutfleet_operator_reconcile_errors_total{{{FLEET}}}", "0+1x30"),
    (f'rolloutfleet_operator_stats_poll_failures_total{{{FLEET}, reason="timeout"}}', "0+2x30"),
    (f"rolloutfleet_operator_watchdog_polls_total{{{FLEET}}}", "0+4x30"),
    (f"rolloutfleet_operator_watchdog_cycles_total{{{FLEET}}}", "0+2x30"),
    (f"rolloutfleet_operator_proxy_rss_budget_bytes{{{FLEET}}}", "1000x30"),
    (f"rolloutfleet_operator_proxy_rss_bytes{{{P0}}}", "950x30"),
    (f"rolloutfleet_operator_proxy_rss_bytes{{{P1}}}", "500x30"),
    (f"rolloutfleet_operator_proxies_in_memory_backoff{{{FLEET}}}", "1x30"),
    (f"rolloutfleet_operator_proxy_rss_budget_bytes{{{GONE}}}", "1000x30"),
    (f'rolloutfleet_operator_proxy_rss_bytes{{{GONE}, pod="gone-proxy-0"}}', "990x30"),
    (f"rolloutfleet_operator_proxies_in_memory_backoff{{{GONE}}}", "1x30"),
    (f"rolloutfleet_operator_watchdog_cycles_total{{{GONE}}}", "9x30"),
    # proxies
    (f"rolloutfleet_proxy_storage_writable{{{P0}}}", "0x30"),
    (f"rolloutfleet_proxy_storage_writable{{{P1}}}", "1x30"),
    (f"rolloutfleet_proxy_dump_failures_total{{{P0}}}", "0x10 1x19"),
    (f"rolloutfleet_proxy_restore_failures_total{{{P0}}}", "2x30"),
    (f"rolloutfleet_proxy_uptime_seconds{{{P0}}}", "60+60x30"),
    (f"rolloutfleet_proxy_restore_failures_total{{{P1}}}", "1x30"),
    (f"rolloutfleet_proxy_uptime_seconds{{{P1}}}", "7200+60x30"),  # long past its start
    (f"rolloutfleet_proxy_ready_trajectories{{{P0}}}", "5000x30"),
    (f"rolloutfleet_proxy_ready_trajectories{{{P1}}}", "10x30"),
    (f"rolloutfleet_proxy_batches_expired_total{{{P0}}}", "0x10 3x19"),
    (f"rolloutfleet_proxy_batches_expired_total{{{P1}}}", "2x30"),
]
# Counters every proxy has: zero unless a series above says otherwise.
for pod in (P0, P1):
    for name in (
        "dump_failures",
        "journal_write_failures",
        "state_write_failures",
        "compaction_failures",
        "restore_failures",
        "sessions_lost",
    ):
        series = f"rolloutfleet_proxy_{name}_total{{{pod}}}"
        if not any(s == series for s, _ in SERIES):
            SERIES.append((series, "0x30"))

FLEET_LABELS = {"namespace": "rl", "fleet": "f"}
P0_LABELS = {**FLEET_LABELS, "pod": "f-proxy-0"}
# At minute 20, exactly these fire (each alert's own `for` has passed); the healthy proxy, the
# deleted fleet and the restore failures of a proxy started long ago do not.
EXPECTED_AT_20M = {
    "RolloutFleetUnavailable": [FLEET_LABELS],
    "RolloutFleetNotReady": [FLEET_LABELS],
    "RolloutFleetReconcileErrors": [FLEET_LABELS],
    "RolloutFleetStatsPollFailures": [FLEET_LABELS],
    "RolloutFleetProxyRssNearBudget": [P0_LABELS],
    "RolloutFleetProxyMemoryBackoff": [FLEET_LABELS],
    "RolloutFleetProxyStorageUnwritable": [P0_LABELS],
    "RolloutFleetProxyWriteFailures": [P0_LABELS],
    "RolloutFleetProxyRestoreFailures": [P0_LABELS],
    "RolloutFleetExportBacklog": [P0_LABELS],
    "RolloutFleetExportsUnacknowledged": [P0_LABELS],
}


def expand_labels(template: str, labels: dict[str, str]) -> str:
    """The annotation as Prometheus renders it: the rules' annotations use only {{ $labels.x }}."""
    expanded = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], template)
    assert "{{" not in expanded, f"annotation uses more than $labels: {template}"
    return expanded


def alert_tests(rules: Iterable[dict], at: str, expected: dict[str, list[dict]]) -> list[dict]:
    tests = []
    for rule in rules:
        alerts = []
        for labels in expected.get(rule["alert"], []):
            alerts.append(
                {
                    "exp_labels": {**rule["labels"], **labels},
                    "exp_annotations": {k: expand_labels(v, labels) for k, v in rule["annotations"].items()},
                }
            )
        tests.append({"eval_time": at, "alertname": rule["alert"], "exp_alerts": alerts})
    return tests


def test_alerts_fire_on_the_troubles_they_name(helm, promtool, tmp_path):
    docs = render(helm, "monitoring.enabled=true", "monitoring.force=true", *SCENARIO_VALUES)
    rules = alert_rules(docs)
    assert set(EXPECTED_AT_20M) == {rule["alert"] for rule in rules}, "every alert has a scenario"
    assert all(rule["labels"]["team"] == "rl-infra" and rule["labels"]["severity"] for rule in rules)
    rules_file = write_rules(tmp_path / "rules.yaml", rule_groups(docs))
    quiet = {}  # at minute 3 no `for` has passed yet; the windowed ones see nothing yet
    tests = {
        "rule_files": [str(rules_file)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": s, "values": v} for s, v in SERIES],
                "alert_rule_test": alert_tests(rules, "20m", EXPECTED_AT_20M)
                + alert_tests(
                    [r for r in rules if r["alert"] != "RolloutFleetProxyRestoreFailures"], "3m", quiet
                ),
            }
        ],
    }
    test_file = tmp_path / "tests.yaml"
    test_file.write_text(yaml.safe_dump(tests, sort_keys=False))
    promtool_run(promtool, "test", "rules", test_file)


def test_rule_values_reach_the_rules(helm):
    docs = render(
        helm,
        "monitoring.enabled=true",
        "monitoring.force=true",
        "monitoring.rules.fleetNotReadyFor=42m",
        "monitoring.rules.fleetUnavailableFor=7m",
        "monitoring.rules.rssBudgetRatio=0.75",
        "monitoring.rules.exportBacklogTrajectories=123",
    )
    by_name = {rule["alert"]: rule for rule in alert_rules(docs)}
    assert by_name["RolloutFleetNotReady"]["for"] == "42m"
    assert by_name["RolloutFleetUnavailable"]["for"] == "7m"
    assert (
        "0.75 * (rolloutfleet_operator_proxy_rss_budget_bytes > 0)"
        in by_name["RolloutFleetProxyRssNearBudget"]["expr"]
    )
    assert by_name["RolloutFleetExportBacklog"]["expr"].endswith("> 123")
