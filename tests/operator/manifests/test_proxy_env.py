"""The proxy settings the operator injects (manifests/proxy_env.py): each reaches the pod's env under
the contract's name, loads in the proxy as it means, and extra env overrides it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from fleet_samples import GPU, MINIMAL, POD, SCHEMA, SVC, container, env_map, mutated, pod_settings, sample
from rolloutfleet_operator.fleet import parse_fleet
from rolloutfleet_operator.manifests.proxy_env import HASH_EXEMPT_ENV, derived_values
from rolloutfleet_operator.manifests.proxy_pod import proxy_pod, template_hash
from rolloutfleet_proxy.settings import ENV, ProxySettings, effective_settings
from rolloutfleet_wire.proxy_settings import INJECTED_SETTINGS

# The env (ordinal 1) and template hash of proxy pods for fleets that together set every injected
# setting, as the operator built them when this file was written. A change here changes what
# running proxies get and, with the hash, rolls every proxy of every fleet on the operator's
# upgrade: make it on purpose, then rewrite the file with
#   ./dev shell -c "PYTHONPATH=tests python tests/operator/manifests/test_proxy_env.py"
GOLDEN = Path(__file__).with_name("proxy_env_golden.json")
KWARGS_GOLDEN = {"enable_thinking": False, "tools": {"strict": True, "order": [2, 1]}}


def golden_fleets() -> dict[str, dict[str, Any]]:
    every = sample("gpu")
    every["spec"]["proxy"].update(
        port=8001,
        replicas=3,
        staleSessionTimeoutSeconds=600.5,
        cleanupIntervalSeconds=10,
        drainGraceSeconds=40,
        exportTtlSeconds=90.0,
        engineLogprobs="original",
        toolCallParser="llama3",
        reasoningParser="deepseek-r1",
        chatTemplateKwargs=KWARGS_GOLDEN,
        routedExperts=True,
        adminKeySecret={"name": "mine", "key": "token"},
        admission={"maxStaleness": 3, "consumerBatchSize": 10, "maxConcurrentSessions": 64},
        memory={"rssBudgetBytes": 4 * 2**30, "refuseNewSessionsPercent": 80},
        env=[{"name": ENV["cleanup_interval_s"], "value": "7"}, {"name": "EXTRA", "value": "x"}],
    )
    every["spec"]["proxy"]["dump"] = {
        "path": "/srv/dumps/",
        "durability": "async",
        "hostPath": {"path": "/d"},
    }
    every["spec"]["gateway"] = {"port": 31000}
    bounded = sample("minimal", namespace="other")
    bounded["spec"]["proxy"].update(
        staleSessionTimeoutSeconds=1800.0,
        admission={"maxConcurrentSessions": 8},
        memory={"rssBudgetBytes": 10**9, "refuseNewSessionsPercent": 0},
        chatTemplateKwargs={"enable_thinking": True},
    )
    return {"gpu": sample("gpu"), "minimal": sample("minimal"), "every-setting": every, "bounded": bounded}


def golden_pods() -> dict[str, Any]:
    pods = {}
    for name, obj in golden_fleets().items():
        fleet = parse_fleet(obj)
        pods[name] = {"env": container(proxy_pod(fleet, 1))["env"], "template_hash": template_hash(fleet)}
    return pods


@pytest.mark.parametrize("name", list(golden_fleets()))
def test_proxy_env_and_template_hash_are_as_recorded(name):
    """Every variable's name, value and place, and the template hash, as recorded (no roll on upgrade)."""
    assert golden_pods()[name] == json.loads(GOLDEN.read_text())[name]


# --- the table: every setting the proxy takes from a fleet field is injected ---------------------


def _schema_paths(node: dict[str, Any], prefix: str) -> list[str]:
    found = []
    for key, sub in (node.get("properties") or {}).items():
        found += [f"{prefix}{key}", *_schema_paths(sub, f"{prefix}{key}.")]
    return found


SPEC_PATHS = _schema_paths(SCHEMA["properties"]["spec"], "")
# Proxy settings with a fleet field that reach the proxy otherwise than by the env (checked below).
AS_ARGUMENTS = {"port": "--port"}


def _setting_words(spec_path: str) -> str:
    """A spec path in the proxy settings' spelling: proxy.admission.maxStaleness ->
    admission_max_staleness, ...Seconds -> ..._s."""
    snake = re.sub(r"([A-Z])", r"_\1", spec_path.removeprefix("proxy.").replace(".", "_")).lower()
    return re.sub(r"_seconds$", "_s", snake)


def test_every_proxy_setting_with_a_fleet_field_is_in_the_table():
    """A proxy setting named like a field of spec.proxy (the whole path, or its last words) is
    injected from that field: a new one without a table entry fails here."""
    table = {setting.name: setting for setting in INJECTED_SETTINGS}
    matched = {}
    for field in ProxySettings.model_fields:
        paths = [
            path
            for path in SPEC_PATHS
            if path.startswith("proxy.") and re.fullmatch(rf"(.+_)?{field}", _setting_words(path))
        ]
        if paths:
            matched[field] = paths
    assert len(matched) >= 12, matched  # the matching itself works
    for field, paths in matched.items():
        if field in AS_ARGUMENTS:
            args = container(POD)["args"]
            assert args[args.index(AS_ARGUMENTS[field]) + 1] == str(GPU.proxy.port)
            continue
        assert field in table, f"proxy setting {field} has a fleet field {paths} but no table entry"
        assert [table[field].spec_path] == paths, field


def test_the_tables_paths_are_the_crds():
    for setting in INJECTED_SETTINGS:
        paths = [setting.spec_path] if setting.spec_path else list(setting.derived_from)
        assert paths and set(paths) <= set(SPEC_PATHS), setting.name
        assert setting.name in ProxySettings.model_fields, setting.name


def test_the_operator_derives_exactly_the_settings_without_a_spec_path():
    derived = {setting.name for setting in INJECTED_SETTINGS if setting.spec_path is None}
    assert set(derived_values(GPU, "p", "http://p")) == derived


def test_every_setting_in_the_table_is_injected():
    """For a fleet that sets every field the table reads, every variable is in the pod, in the
    table's order, before the spec's own env."""
    fleet = parse_fleet(golden_fleets()["every-setting"])
    names = [entry["name"] for entry in container(proxy_pod(fleet, 0))["env"]]
    user = [entry["name"] for entry in fleet.proxy.env]
    assert [name for name in names if name not in user] == [
        setting.env_name for setting in INJECTED_SETTINGS if setting.env_name not in user
    ]
    assert names[-len(user) :] == user
    assert {ENV["staleness_batch_share"], ENV["rss_soft_limit_bytes"]} == HASH_EXEMPT_ENV


GPU_ROWS = [
    ("env: upstream", env_map(POD)[ENV["upstream_url"]], "http://gpu-fleet-gateway.rl.svc:30080"),
    ("env: tokenizer", env_map(POD)[ENV["tokenizer_path"]], "/models"),
    ("env: stale timeout", env_map(POD)[ENV["stale_session_timeout_s"]], "1800"),
    ("env: cleanup interval", env_map(POD)[ENV["cleanup_interval_s"]], "30"),
    ("env: dump dir", env_map(POD)[ENV["dump_dir"]], "/var/lib/rolloutfleet/dumps/gpu-fleet-proxy-2"),
    ("env: drain grace", env_map(POD)[ENV["drain_grace_s"]], "25"),
    ("env: public url", env_map(POD)[ENV["public_url"]], f"http://gpu-fleet-proxy-2.{SVC}.rl.svc:8000"),
    ("env: tool call parser", env_map(POD)[ENV["tool_call_parser"]], "qwen25"),
    ("env: reasoning parser", env_map(POD)[ENV["reasoning_parser"]], "qwen3"),
    (
        "env: admin key",
        env_map(POD)[ENV["admin_key"]],
        {"secretKeyRef": {"name": "gpu-fleet-admin-key", "key": "admin-key"}},
    ),
    ("env: no downward-API pod ip (binds the wildcard)", "POD_IP" in env_map(POD), False),
    ("env: extra", env_map(POD)["ROLLOUTFLEET_PROXY_LOG_LEVEL"], "info"),
    ("extra env last", container(POD)["env"][-1]["name"], "ROLLOUTFLEET_PROXY_LOG_LEVEL"),
]


@pytest.mark.parametrize(("what", "actual", "expected"), GPU_ROWS, ids=[row[0] for row in GPU_ROWS])
def test_gpu_sample_reaches_the_proxy_env(what, actual, expected):
    assert actual == expected, what


def test_extra_env_overrides_an_injected_setting_and_the_spec_admin_secret_is_used():
    obj = sample("minimal")
    obj["spec"]["proxy"]["env"] = [
        {"name": ENV["drain_grace_s"], "value": "5"},
        {"name": "EXTRA", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "k"}}},
    ]
    obj["spec"]["proxy"]["adminKeySecret"] = {"name": "mine", "key": "token"}
    fleet = parse_fleet(obj)
    pod = proxy_pod(fleet, 0)
    env = env_map(pod)  # also asserts each name appears once
    assert env[ENV["drain_grace_s"]] == "5"
    assert [e["name"] for e in container(pod)["env"]][-2:] == [ENV["drain_grace_s"], "EXTRA"]
    assert env[ENV["admin_key"]] == {"secretKeyRef": {"name": "mine", "key": "token"}}
    assert not fleet.generates_admin_key and GPU.generates_admin_key


def test_injected_settings_load_in_the_proxy(monkeypatch):
    """The pod's env and args, as the kubelet would resolve them, are valid proxy settings."""
    settings = pod_settings(proxy_pod(GPU, 1), monkeypatch)
    assert settings.host == "0.0.0.0" and settings.port == 8000
    assert settings.upstream_url == "http://gpu-fleet-gateway.rl.svc:30080"
    assert settings.tokenizer_path == "/models"
    assert settings.stale_session_timeout_s == 1800 and settings.cleanup_interval_s == 30
    assert str(settings.dump_dir) == "/var/lib/rolloutfleet/dumps/gpu-fleet-proxy-1"
    assert settings.drain_grace_s == 25
    assert settings.public_url == f"http://gpu-fleet-proxy-1.{SVC}.rl.svc:8000"
    assert settings.admin_key.get_secret_value() == "secret"
    assert settings.log_level == "info"
    assert settings.tool_call_parser == "qwen25" and settings.reasoning_parser == "qwen3"
    assert settings.chat_template_kwargs == {}


# --- admission and memory: settings that follow the fleet's scale and budget ---------------------


def test_scaling_changes_the_batch_share_of_new_pods_without_rolling_the_others():
    admission = {"maxStaleness": 4, "consumerBatchSize": 10}
    fleets = {
        n: parse_fleet(mutated("proxy.replicas", n, mutated("proxy.admission", admission))) for n in (3, 4)
    }
    assert template_hash(fleets[3]) == template_hash(fleets[4])
    for replicas, share in ((3, "4"), (4, "3")):  # ceil(10 / replicas): the fleet admits a whole batch
        env = {e["name"]: e.get("value") for e in container(proxy_pod(fleets[replicas], 0))["env"]}
        assert env[ENV["max_staleness"]] == "4" and env[ENV["staleness_batch_share"]] == share


@pytest.mark.parametrize(
    ("replicas", "batch", "share"), [(1, 1, 1), (4, 2, 1), (4, 8, 2), (3, 10, 4), (0, 5, 5)]
)
def test_batch_share_is_rounded_up_and_at_least_one(replicas, batch, share):
    spec = {"maxStaleness": 0, "consumerBatchSize": batch}
    assert parse_fleet(mutated("proxy.admission", spec)).proxy.admission.batch_share(replicas) == share


def test_memory_soft_limit_and_export_ttl_reach_the_proxy():
    fleet = parse_fleet(
        mutated("proxy.exportTtlSeconds", 90, mutated("proxy.memory.refuseNewSessionsPercent", 80))
    )
    env = {e["name"]: e.get("value") for e in container(proxy_pod(fleet, 0))["env"]}
    assert env[ENV["rss_soft_limit_bytes"]] == str(6442450944 * 80 // 100)
    assert env[ENV["export_ttl_s"]] == "90"
    off = parse_fleet(mutated("proxy.memory.refuseNewSessionsPercent", 0))
    assert ENV["rss_soft_limit_bytes"] not in {e["name"] for e in container(proxy_pod(off, 0))["env"]}
    assert env[ENV["max_staleness"]] == "2" and env[ENV["max_concurrent_sessions"]] == "512"
    unbounded = parse_fleet(mutated("proxy.admission", {}))
    names = {e["name"] for e in container(proxy_pod(unbounded, 0))["env"]}
    assert not names & {ENV["max_staleness"], ENV["staleness_batch_share"], ENV["max_concurrent_sessions"]}


# --- the served model's chat formats (SGLang's parser names, default chat template keywords) -----

CHAT_FORMAT_ENV = {ENV["tool_call_parser"], ENV["reasoning_parser"], ENV["chat_template_kwargs"]}
KWARGS: dict[str, Any] = {
    "enable_thinking": False,
    "thinking_budget": 512,
    "tools": {"strict": True, "order": [2, 1]},
}


def test_chat_formats_reach_the_proxy_when_set(monkeypatch):
    obj = sample("minimal")
    obj["spec"]["proxy"].update(
        toolCallParser="llama3", reasoningParser="deepseek-r1", chatTemplateKwargs=KWARGS
    )
    fleet = parse_fleet(obj)
    kwargs = fleet.spec_value("proxy.chatTemplateKwargs")
    assert kwargs == KWARGS and kwargs is not KWARGS  # the fleet holds a copy
    pod = proxy_pod(fleet, 0)
    env = env_map(pod)
    assert env[ENV["tool_call_parser"]] == "llama3" and env[ENV["reasoning_parser"]] == "deepseek-r1"
    assert env[ENV["chat_template_kwargs"]] == (
        '{"enable_thinking":false,"thinking_budget":512,"tools":{"order":[2,1],"strict":true}}'
    )
    # They round-trip through the proxy's settings: a JSON object in, the same dict out (also in
    # what GET /v1/settings reports, which the e2e suite compares with the pod's env).
    settings = pod_settings(pod, monkeypatch)
    assert (settings.tool_call_parser, settings.reasoning_parser) == ("llama3", "deepseek-r1")
    assert settings.chat_template_kwargs == KWARGS
    reported = effective_settings(settings)
    assert reported["chat_template_kwargs"] == json.loads(env[ENV["chat_template_kwargs"]]) == KWARGS
    assert reported["tool_call_parser"] == env[ENV["tool_call_parser"]]
    assert reported["reasoning_parser"] == env[ENV["reasoning_parser"]]


@pytest.mark.parametrize(
    "proxy",
    [
        {},
        {"chatTemplateKwargs": {}},
        {"toolCallParser": None, "reasoningParser": None, "chatTemplateKwargs": None},
    ],
    ids=["absent", "empty keywords", "null"],
)
def test_chat_formats_are_not_injected_when_unset(proxy, monkeypatch):
    obj = sample("minimal")
    obj["spec"]["proxy"].update(proxy)
    fleet = parse_fleet(obj)
    assert (
        fleet.spec_value("proxy.toolCallParser") is None and fleet.spec_value("proxy.reasoningParser") is None
    )
    assert not fleet.spec_value("proxy.chatTemplateKwargs")
    pod = proxy_pod(fleet, 0)
    assert not CHAT_FORMAT_ENV & set(env_map(pod))
    # The proxy's defaults apply; and an unset field does not change the pod (no roll on upgrade).
    settings = pod_settings(pod, monkeypatch)
    for field in ("tool_call_parser", "reasoning_parser", "chat_template_kwargs"):
        default = ProxySettings.model_fields[field].get_default(call_default_factory=True)
        assert getattr(settings, field) == default, field
    assert template_hash(fleet) == template_hash(MINIMAL)


def test_chat_template_kwargs_json_is_stable():
    """The same keywords in another key order give the same value and hash; another value rolls."""
    reordered = {"tools": {"order": [2, 1], "strict": True}, "thinking_budget": 512, "enable_thinking": False}
    assert reordered == KWARGS and list(reordered) != list(KWARGS)
    assert list(reordered["tools"]) != list(KWARGS["tools"])
    fleets = [parse_fleet(mutated("proxy.chatTemplateKwargs", kwargs)) for kwargs in (KWARGS, reordered)]
    values = {env_map(proxy_pod(fleet, 0))[ENV["chat_template_kwargs"]] for fleet in fleets}
    assert len(values) == 1
    assert json.loads(values.pop()) == KWARGS
    assert template_hash(fleets[0]) == template_hash(fleets[1])
    flipped = parse_fleet(mutated("proxy.chatTemplateKwargs", {**KWARGS, "enable_thinking": True}))
    assert template_hash(flipped) != template_hash(fleets[0])
    # A list's order is data, not layout: it is kept, and changing it is a change.
    tools = {"strict": True, "order": [1, 2]}
    swapped = parse_fleet(mutated("proxy.chatTemplateKwargs", {**KWARGS, "tools": tools}))
    assert template_hash(swapped) != template_hash(fleets[0])


def test_chat_formats_are_template_settings():
    assert not CHAT_FORMAT_ENV & HASH_EXEMPT_ENV


# --- routing replay (R3) -------------------------------------------------------------------------


def test_routing_replay_reaches_the_proxy_when_on_and_rolls_nothing_when_off(monkeypatch):
    on = parse_fleet(mutated("proxy.routedExperts", True))
    pod = proxy_pod(on, 0)
    assert env_map(pod)[ENV["routed_experts"]] == "true"
    settings = pod_settings(pod, monkeypatch)
    assert settings.routed_experts is True and effective_settings(settings)["routed_experts"] is True
    assert template_hash(on) != template_hash(GPU)  # turning it on rolls the proxies
    # Off (explicitly, or by the CRD's default): not injected, the proxy's own default (off) applies,
    # and a fleet's pods are the same as before the setting existed.
    off = parse_fleet(mutated("proxy.routedExperts", False))
    assert off.spec_value("proxy.routedExperts") is False
    assert ENV["routed_experts"] not in env_map(proxy_pod(off, 0))
    assert pod_settings(proxy_pod(off, 0), monkeypatch).routed_experts is False
    assert template_hash(off) == template_hash(GPU)


if __name__ == "__main__":  # rewrite the recorded env (see GOLDEN)
    GOLDEN.write_text(json.dumps(golden_pods(), indent=1, sort_keys=True) + "\n")
