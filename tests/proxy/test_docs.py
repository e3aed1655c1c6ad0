"""docs/proxy.md must keep up with the code: every setting, route, /stats field, metric and error code
is documented."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import rolloutfleet_proxy
from rolloutfleet_proxy.app import create_app
from rolloutfleet_proxy.settings import ENV, ProxySettings
from rolloutfleet_proxy.stats import StatsCollector
from rolloutfleet_wire.errors import ErrorCode

DOC = Path(__file__).resolve().parents[2] / "docs" / "proxy.md"


@pytest.fixture(scope="module")
def doc() -> str:
    return DOC.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def app():
    settings = ProxySettings(
        upstream_url="http://127.0.0.1:1", tokenizer_path="/x", admin_key="k", allow_dropping_sessions=True
    )
    return create_app(settings)  # built, never started: no tokenizer, no upstream, no sockets


def test_every_setting_is_documented(doc):
    assert set(ENV) == set(ProxySettings.model_fields)
    missing = [
        f"{field}: {part}"
        for field, env_name in ENV.items()
        for part in (f"`{env_name}`", f"`--{field.replace('_', '-')}`")
        if part not in doc
    ]
    assert not missing, f"settings missing from {DOC.name}: {missing}"


def documented_default(value: object) -> str:
    """A default as the settings table writes it: `None` is "unset", booleans are lower case."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{json.dumps(value) if isinstance(value, dict | list) else value}`"


def test_the_documented_defaults_are_the_settings(doc):
    row = re.compile(r"\| `([a-z_0-9]+)` \| `--[^|]*` \| `ROLLOUTFLEET_PROXY_[A-Z_0-9]+` \| ([^|]*) \|")
    cells = {}
    for line in doc.splitlines():
        match = row.match(line)
        if match:
            cells[match.group(1)] = match.group(2).strip()
    assert sorted(set(ProxySettings.model_fields) - set(cells)) == []
    wrong = {}
    for name, field in ProxySettings.model_fields.items():
        if field.is_required():
            want = "required"
        else:
            want = documented_default(field.get_default(call_default_factory=True))
        shown = cells[name].split(" (")[0]  # "`8388608` (8 MiB)": the unit in brackets is a reading aid
        if shown != want:
            wrong[name] = (cells[name], want)
    assert not wrong, f"defaults in {DOC.name} differ from the settings' (documented, code): {wrong}"


def test_every_route_is_documented(doc, app):
    routes = {
        (method, route.path)
        for route in app.routes
        if getattr(route, "path", None)
        for method in (getattr(route, "methods", None) or {"GET"})
        if method != "HEAD"
    }
    assert ("POST", "/v1/sessions/{session_id}/chat/completions") in routes
    missing = sorted(f"{method} {path}" for method, path in routes if f"`{method} {path}`" not in doc)
    assert not missing, f"routes missing from {DOC.name}: {missing}"


def test_every_stats_field_and_metric_is_documented(doc, app):
    stats = app.state.runtime.stats()
    nested = ("totals", "admission")
    fields = [name for name in stats if name not in nested] + [f for n in nested for f in stats[n]]
    metrics = [
        metric.name + ("_total" if metric.type == "counter" else "")
        for metric in StatsCollector(app.state.runtime.stats).collect()
    ]
    missing = [name for name in fields + metrics if f"`{name}`" not in doc]
    assert not missing, f"/stats fields or metrics missing from {DOC.name}: {missing}"


def test_every_error_code_is_documented(doc):
    missing = [code.value for code in ErrorCode if f"`{code.value}`" not in doc]
    assert not missing, f"error codes missing from {DOC.name}: {missing}"


# Calls that take an error code, and the position of that argument.
CODE_ARGUMENTS = {
    "bad_request": 0,
    "conflict": 0,
    "gone": 0,
    "too_many": 0,
    "unavailable": 0,
    "ProxyError": 1,
    "error_response": 1,
    "error_body": 1,
    "BatchEnded": 1,
    "release": 1,
    "_reject": 3,
}


def test_the_proxy_answers_only_with_error_code_members():
    """Codes are `ErrorCode` members, never string literals: a code outside the vocabulary would be
    undocumented, and unknown to the clients."""
    package = Path(rolloutfleet_proxy.__file__).parent
    literals = []
    for path in sorted(package.rglob("*.py")):  # the subpackages too
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            codes = []
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                position = CODE_ARGUMENTS.get(name)
                if position is not None:
                    codes = [k.value for k in node.keywords if k.arg == "code"]
                    codes += node.args[position : position + 1]
            elif isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any((getattr(t, "id", None) or getattr(t, "attr", None)) == "code" for t in targets):
                    codes = [node.value]  # `code = ...`, as the failure classes set it
            literals += [
                f"{path.name}:{node.lineno}: {code.value!r}"
                for code in codes
                if isinstance(code, ast.Constant) and isinstance(code.value, str)
            ]
    assert not literals, f"error codes given as string literals: {literals}"
