"""docs/operator.md must keep up with the operator, its CRD and its chart.

Every spec and status field of the CRD's schema, every CEL rule and its message, every printer
column, every condition type with each reason the code can produce, every Event reason, every
metric (with its labels), every chart value, every operator flag and every environment variable
the operator injects into proxies must be in the doc. Names are looked for in backticks: field
paths relative to `spec` (`proxy.memory.rssBudgetBytes`), status paths with their prefix
(`status.memoryRestarts.total`).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase
from rolloutfleet_operator import metrics, pod_problems, watchdog
from rolloutfleet_operator.conditions import (
    FLEET_CONDITION_TYPES,
    ObservedState,
    fleet_conditions,
)
from rolloutfleet_operator.fleet import MemorySpec
from rolloutfleet_operator.manifests.proxy_env import HASH_EXEMPT_ENV
from rolloutfleet_operator.plan import ProxyPodView
from rolloutfleet_testkit.crdgen import source_crd
from rolloutfleet_wire.fleet_defaults import SPEC_DEFAULTS
from rolloutfleet_wire.proxy_settings import INJECTED_SETTINGS

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "operator.md"
CHART = ROOT / "charts" / "rolloutfleet-operator"
OPERATOR = ROOT / "operator" / "rolloutfleet_operator"
NOW = "2026-01-01T00:00:00Z"


@pytest.fixture(scope="module")
def doc() -> str:
    return DOC.read_text(encoding="utf-8")


def missing_in(doc: str, names) -> list[str]:
    return sorted({name for name in names if f"`{name}`" not in doc})


def table_rows(doc: str) -> list[str]:
    return [line for line in doc.splitlines() if line.startswith("|")]


# --- the CRD ---------------------------------------------------------------------------------------


def schema() -> dict[str, Any]:
    """The CRD's source: fields of Kubernetes' own types (affinity, tolerations, volumes, ...) are
    leaves there, documented by Kubernetes."""
    (version,) = source_crd()["spec"]["versions"]
    return version


def field_paths(node: dict[str, Any], prefix: str = "") -> Iterator[str]:
    """Every property below `node`, objects and leaves, as dotted paths (arrays are leaves)."""
    for name, child in (node.get("properties") or {}).items():
        path = f"{prefix}{name}"
        yield path
        yield from field_paths(child, path + ".")


def schema_nodes(node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, child in (node.get("properties") or {}).items():
        yield from schema_nodes(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from schema_nodes(node["items"], f"{path}[]")


def test_every_spec_field_is_documented(doc):
    paths = list(field_paths(schema()["schema"]["openAPIV3Schema"]["properties"]["spec"]))
    # The walk reaches objects, leaves and the nested sections.
    assert {"proxy", "proxy.memory", "proxy.memory.rssBudgetBytes", "proxy.dump.hostPath.path"} <= set(paths)
    assert {"gateway.policy", "engines.gpusPerEngine", "externalEngineUrls"} <= set(paths)
    missing = missing_in(doc, paths)
    assert not missing, f"spec fields missing from {DOC.name}: {missing}"


def spec_field_cells(doc: str) -> dict[str, list[str]]:
    """The rows of the spec field tables (Field | Type | Default | Meaning | Reaches), by field; an
    escaped `\\|` inside a cell (`sync` \\| `async`) stays in its cell."""
    rows = {}
    for line in table_rows(doc):
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if len(cells) == 5 and re.fullmatch(r"`[A-Za-z.]+`", cells[0]):
            rows[cells[0].strip("`")] = cells
    return rows


def test_the_documented_defaults_are_the_crds(doc):
    rows = spec_field_cells(doc)
    assert "proxy.dump.durability" in rows  # a row with an escaped bar in its type
    shown = {field: rows[field][2] for field in SPEC_DEFAULTS if field in rows}
    assert sorted(set(SPEC_DEFAULTS) - set(shown)) == []
    want = {
        field: f"`{str(value).lower() if isinstance(value, bool) else value}`"
        for field, value in SPEC_DEFAULTS.items()
    }
    wrong = {field: (shown[field], want[field]) for field in shown if shown[field] != want[field]}
    assert not wrong, f"defaults in {DOC.name} differ from the CRD's (documented, CRD): {wrong}"


def test_every_status_field_is_documented(doc):
    status = schema()["schema"]["openAPIV3Schema"]["properties"]["status"]
    paths = list(field_paths(status, "status."))
    assert "status.memoryRestarts.lastTime" in paths
    missing = missing_in(doc, paths)
    assert not missing, f"status fields missing from {DOC.name}: {missing}"


def test_every_cel_rule_and_message_is_documented(doc):
    validations = [
        (path, rule)
        for path, node in schema_nodes(schema()["schema"]["openAPIV3Schema"], "")
        for rule in node.get("x-kubernetes-validations") or ()
    ]
    assert len(validations) >= 6
    missing = [
        f"{path}: {part}"
        for path, rule in validations
        for part in (f"`{rule['rule']}`", rule["message"])
        if part not in doc
    ]
    assert not missing, f"CEL rules or messages missing from {DOC.name}: {missing}"


def test_every_printer_column_is_documented(doc):
    columns = [column["name"] for column in schema()["additionalPrinterColumns"]]
    missing = missing_in(doc, columns)
    assert not missing, f"printer columns missing from {DOC.name}: {missing}"


# --- conditions ------------------------------------------------------------------------------------


def pod(ordinal: int, ready: bool = True, **fields: Any) -> ProxyPodView:
    fields.setdefault("template_hash", "current")
    fields.setdefault("phase", "Running")
    return ProxyPodView(name=f"f-proxy-{ordinal}", ordinal=ordinal, ready=ready, **fields)


def problem(reason: str) -> pod_problems.PodProblem:
    return pod_problems.PodProblem("f-x", reason, "why")


def observed(desired: int, *pods: ProxyPodView, **fields: Any) -> ObservedState:
    fields.setdefault("gateway_ready", 1)
    return ObservedState(desired_proxies=desired, proxies=pods, current_hash="current", **fields)


# One scenario per branch of conditions.py: together they produce every (type, reason) it can.
FLEET_SCENARIOS = {
    "all ready, external engines": observed(2, pod(0), pod(1)),
    "all ready, managed engines": observed(1, pod(0), engines_ready=2, engines_desired=2),
    "everything scaled to zero": observed(0, gateway_ready=0, gateway_desired=0, engines_desired=0),
    "engines not ready": observed(1, pod(0), engines_ready=1, engines_desired=2),
    "gateway not ready": observed(1, pod(0), gateway_ready=0),
    "scaling up": observed(2, pod(0)),
    "scaling down": observed(1, pod(0), pod(1)),
    "rolling update": observed(1, pod(0, template_hash="old")),
    "waiting for ready": observed(1, pod(0, ready=False)),
    "terminating": observed(1, pod(0), pod(1, deleting=True)),
    "failed pod": observed(1, pod(0, ready=False, phase="Failed")),
    "create refused, all else ready": observed(1, pod(0), create_failures=("Pod/f-proxy-1: denied",)),
    "proxies unavailable": observed(3, pod(0)),
    "gateway unavailable": observed(1, pod(0), gateway_available=False),
    "being created": observed(2, pod(0), pod(1, deleting=True), pod(2)),
    **{
        f"a proxy pod: {reason}": observed(1, pod(0, ready=False, problem=problem(reason)))
        for reason in pod_problems.PROBLEM_REASONS
    },
    **{
        f"a gateway pod: {reason}": observed(1, pod(0), gateway_ready=0, gateway_problems=(problem(reason),))
        for reason in pod_problems.PROBLEM_REASONS
    },
    **{
        f"an engine pod: {reason}": observed(
            1, pod(0), engines_ready=0, engines_desired=1, engine_problems=(problem(reason),)
        )
        for reason in pod_problems.PROBLEM_REASONS
    },
}

SPEC = MemorySpec(
    rss_budget_bytes=100,
    check_interval_s=15,
    consecutive_samples=1,
    max_unavailable=1,
    cooldown_s=300,
    max_cooldown_s=3600,
    dry_run=False,
)
RESTART = watchdog.Restart("f-proxy-0", 200, 3, 1, 300)
MEMORY_SCENARIOS = {
    "off": watchdog.Decision(enabled=False),
    "within budget": watchdog.Decision(enabled=True),
    "restarting": watchdog.Decision(enabled=True, restart=(RESTART,)),
    "waiting for maxUnavailable": watchdog.Decision(
        enabled=True, held=(watchdog.Hold("f-proxy-0", watchdog.MAX_UNAVAILABLE, 200),)
    ),
    "dry run": watchdog.Decision(enabled=True, held=(watchdog.Hold("f-proxy-0", watchdog.DRY_RUN, 200),)),
    "cooldown": watchdog.Decision(
        enabled=True, held=(watchdog.Hold("f-proxy-0", watchdog.COOLDOWN, 200, 1000.0, 1),)
    ),
    "backoff": watchdog.Decision(
        enabled=True, held=(watchdog.Hold("f-proxy-0", watchdog.BACKOFF, 200, 1000.0, 2),)
    ),
    "poll failures": watchdog.Decision(
        enabled=True, poll_failures=(watchdog.PollTrouble("f-proxy-0", 3, "no answer within 5s"),)
    ),
}


def produced_conditions() -> set[tuple[str, str]]:
    pairs = set()
    for state in FLEET_SCENARIOS.values():
        for condition in fleet_conditions(state, 1, NOW, []):
            pairs.add((condition["type"], condition["reason"]))
    for decision in MEMORY_SCENARIOS.values():
        condition = watchdog.memory_condition(decision)
        pairs.add((condition.type, condition.reason))
    # And the same through the watchdog's own decision, as the operator makes it.
    state = watchdog.observe(watchdog.FleetMemoryState(), {"f-proxy-0": watchdog.RssSample(200)}, 0.0, SPEC)
    condition = watchdog.memory_condition(watchdog.decide(state, [pod(0)], 0.0, SPEC, desired=1))
    pairs.add((condition.type, condition.reason))
    for samples in (
        {"f-proxy-0": watchdog.RssSample(200)},
        {"f-proxy-0": watchdog.RssSample(200, "OSError: [Errno 28] No space left on device")},
        {"f-proxy-0": watchdog.PollFailure("refused")},
    ):
        reports = watchdog.storage_reports({}, samples, {"f-proxy-0": "uid"})
        for enabled in (True, False):
            condition = watchdog.storage_condition(reports, enabled=enabled)
            pairs.add((condition.type, condition.reason))
    return pairs


def literal_reasons(path: Path) -> set[str]:
    """Reasons written as literals in a module: the third argument of `Condition(type, status,
    reason, ...)` calls, and strings assigned to a variable named `reason` (passed on to Condition)."""
    reasons = set()
    for node in ast.walk(ast.parse(path.read_text())):
        values = []
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Condition" and node.args[2:]:
            values = [node.args[2]]
        elif isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "reason" for t in node.targets):
            values = [node.value]
        reasons |= {v.value for v in values if isinstance(v, ast.Constant) and isinstance(v.value, str)}
    return reasons


def test_the_scenarios_reach_every_condition_the_code_writes():
    pairs = produced_conditions()
    types = {t for t, _ in pairs}
    assert types == {*FLEET_CONDITION_TYPES, watchdog.MEMORY_PRESSURE, watchdog.STORAGE_WRITABLE}
    literals = literal_reasons(OPERATOR / "conditions.py") | literal_reasons(OPERATOR / "watchdog.py")
    literals |= set(pod_problems.PROBLEM_REASONS)
    assert len(literals) >= 20
    unreached = literals - {r for _, r in pairs}
    assert not unreached, f"add a scenario to this test for the condition reasons {sorted(unreached)}"
    ready = {r for t, r in pairs if t == "Ready"}
    assert {"ProxiesNotReady", "GatewayNotReady", "EnginesNotReady", "ReplicaFailure"} <= ready


def test_every_condition_type_and_reason_is_documented(doc):
    rows = table_rows(doc)
    missing = sorted(
        f"{type_}/{reason}"
        for type_, reason in produced_conditions()
        if not any(f"`{type_}`" in row and f"`{reason}`" in row for row in rows)
    )
    assert not missing, f"conditions (type/reason, in one table row) missing from {DOC.name}: {missing}"


# --- Events ----------------------------------------------------------------------------------------


def event_reasons() -> set[str]:
    """Literal Event reasons: kopf.info/warn/event(reason=...) and post_event(obj, type, reason, ...);
    a pass's (type, reason, message) tuples (pass_events.py); the reconciler's deletion reasons
    (plan.Deletion); the watchdog's MemoryRestart<HoldReason>."""
    reasons = set()
    for module in ("main.py", "memory_watchdog.py", "plan.py", "pass_events.py"):
        for node in ast.walk(ast.parse((OPERATOR / module).read_text())):
            if isinstance(node, ast.Tuple) and len(node.elts) == 3:
                kind, reason = node.elts[0], node.elts[1]
                typed = isinstance(kind, ast.Constant) and kind.value in ("Normal", "Warning")
                if typed and isinstance(reason, ast.Constant) and isinstance(reason.value, str):
                    reasons.add(reason.value)
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            candidates = []
            if name in ("info", "warn", "event", "exception"):
                candidates = [kw.value for kw in node.keywords if kw.arg == "reason"]
            elif name in ("post_event", "Deletion") and len(node.args) >= 3:
                candidates = [node.args[2]]  # post_event(obj, type, reason, ...), Deletion(name, i, reason)
            reasons |= {
                c.value for c in candidates if isinstance(c, ast.Constant) and isinstance(c.value, str)
            }
    reasons |= {f"MemoryRestart{hold}" for hold in get_args(watchdog.HoldReason)}
    return reasons


def test_every_event_reason_is_documented(doc):
    reasons = event_reasons()
    assert {"Created", "FailedCreate", "ScaleDown", "RollingUpdate", "MemoryRestart"} <= reasons
    assert "MemoryRestartMaxUnavailable" in reasons
    missing = missing_in(doc, reasons)
    assert not missing, f"Event reasons missing from {DOC.name}: {missing}"


# --- metrics ---------------------------------------------------------------------------------------


def operator_metrics() -> list[MetricWrapperBase]:
    return [value for value in vars(metrics).values() if isinstance(value, MetricWrapperBase)]


def test_every_metric_and_its_labels_are_documented(doc):
    found = operator_metrics()
    assert len(found) >= 11
    rows = table_rows(doc)
    missing = []
    for metric in found:
        name = metric._name + ("_total" if metric._type == "counter" else "")
        row = next((r for r in rows if r.startswith(f"| `{name}`")), None)
        if row is None:
            missing.append(name)
            continue
        missing += [f"{name}{{{label}}}" for label in metric._labelnames if f"`{label}`" not in doc]
        missing += [
            f"{name}{{{label}}} (in its row)"
            for label in metric._labelnames
            if label not in metrics.FLEET and f"`{label}`" not in row
        ]
    assert not missing, f"metrics missing from {DOC.name}: {missing}"


# --- chart, flags, injected environment ------------------------------------------------------------


def test_every_chart_value_is_documented(doc):
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    top = [key for key in values if f"`{key}`" not in doc and f"`{key}." not in doc]
    used = set()
    for template in (CHART / "templates").iterdir():
        used |= set(re.findall(r"\.Values\.([A-Za-z0-9_.]+)", template.read_text()))
    assert {"image.repository", "watchNamespaces", "serviceAccount.create"} <= used
    missing = sorted(set(top) | set(missing_in(doc, used)))
    assert not missing, f"chart values missing from {DOC.name}: {missing}"


def test_every_operator_flag_is_documented(doc):
    flags = [
        node.args[0].value
        for node in ast.walk(ast.parse((OPERATOR / "main.py").read_text()))
        if isinstance(node, ast.Call)
        and getattr(node.func, "attr", None) == "add_argument"
        and isinstance(node.args[0], ast.Constant)
    ]
    assert "--all-namespaces" in flags and len(flags) >= 6
    missing = [flag for flag in flags if not re.search(rf"`{re.escape(flag)}[` ]", doc)]
    assert not missing, f"operator flags missing from {DOC.name}: {missing}"


def test_every_injected_proxy_variable_is_documented(doc):
    """Every variable of the settings table is in the doc; one read from a spec field is named in
    that field's row; those outside the template hash are in its section's table."""
    missing = missing_in(doc, {setting.env_name for setting in INJECTED_SETTINGS})
    assert not missing, f"injected environment variables missing from {DOC.name}: {missing}"
    rows = table_rows(doc)
    for setting in INJECTED_SETTINGS:
        if setting.spec_path is not None:
            (row,) = [r for r in rows if r.startswith(f"| `{setting.spec_path}` |")]
            assert f"`{setting.env_name}`" in row, setting.spec_path
    hash_section = doc[doc.index("### The template hash and the settings outside it") :]
    assert HASH_EXEMPT_ENV and not missing_in(hash_section[: hash_section.index("\n## ")], HASH_EXEMPT_ENV)
