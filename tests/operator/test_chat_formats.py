"""The served model's chat formats (SGLang's parser names, default chat template keywords) reach the proxy."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fleet_samples import MINIMAL, SCHEMA, env_map, mutated, pod_settings, sample
from rolloutfleet_operator import manifests
from rolloutfleet_operator.fleet import parse_fleet
from rolloutfleet_proxy.reasoning_parsers import REASONING_PARSER_NAMES
from rolloutfleet_proxy.settings import ENV, ProxySettings, effective_settings
from rolloutfleet_proxy.tool_parsers import TOOL_CALL_PARSER_NAMES

CHAT_FORMAT_ENV = {ENV["tool_call_parser"], ENV["reasoning_parser"], ENV["chat_template_kwargs"]}
KWARGS = {"enable_thinking": False, "thinking_budget": 512, "tools": {"strict": True, "order": [2, 1]}}


def proxy_schema(field: str) -> dict[str, Any]:
    return SCHEMA["properties"]["spec"]["properties"]["proxy"]["properties"][field]


def test_crd_parser_names_are_the_proxys_registries():
    """One source of truth: the CRD offers exactly the parsers the proxy has (SGLang's names)."""
    for field, registry in (
        ("toolCallParser", TOOL_CALL_PARSER_NAMES),
        ("reasoningParser", REASONING_PARSER_NAMES),
    ):
        enum = proxy_schema(field)["enum"]
        assert len(enum) == len(set(enum)) and set(enum) == set(registry), field
        assert proxy_schema(field)["type"] == "string" and "SGLang" in proxy_schema(field)["description"]
    kwargs = proxy_schema("chatTemplateKwargs")
    # Without it the API server would prune every key of the object (it declares no properties).
    assert kwargs["type"] == "object" and kwargs["x-kubernetes-preserve-unknown-fields"] is True


def test_chat_formats_reach_the_proxy_when_set(monkeypatch):
    obj = sample("minimal")
    obj["spec"]["proxy"].update(
        toolCallParser="llama3", reasoningParser="deepseek-r1", chatTemplateKwargs=KWARGS
    )
    fleet = parse_fleet(obj)
    assert (fleet.proxy.tool_call_parser, fleet.proxy.reasoning_parser) == ("llama3", "deepseek-r1")
    assert fleet.proxy.chat_template_kwargs == KWARGS and fleet.proxy.chat_template_kwargs is not KWARGS
    pod = manifests.proxy_pod(fleet, 0)
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
    assert fleet.proxy.tool_call_parser is None and fleet.proxy.reasoning_parser is None
    assert fleet.proxy.chat_template_kwargs == {}
    pod = manifests.proxy_pod(fleet, 0)
    assert not CHAT_FORMAT_ENV & set(env_map(pod))
    # The proxy's defaults apply; and an unset field does not change the pod (no roll on upgrade).
    settings = pod_settings(pod, monkeypatch)
    for field in ("tool_call_parser", "reasoning_parser", "chat_template_kwargs"):
        default = ProxySettings.model_fields[field].get_default(call_default_factory=True)
        assert getattr(settings, field) == default, field
    assert manifests.template_hash(fleet) == manifests.template_hash(MINIMAL)


def test_chat_template_kwargs_json_is_stable():
    """The same keywords in another key order give the same value and hash; another value rolls."""
    reordered = {"tools": {"order": [2, 1], "strict": True}, "thinking_budget": 512, "enable_thinking": False}
    assert reordered == KWARGS and list(reordered) != list(KWARGS)
    assert list(reordered["tools"]) != list(KWARGS["tools"])
    fleets = [parse_fleet(mutated("proxy.chatTemplateKwargs", kwargs)) for kwargs in (KWARGS, reordered)]
    values = {env_map(manifests.proxy_pod(fleet, 0))[ENV["chat_template_kwargs"]] for fleet in fleets}
    assert len(values) == 1
    assert json.loads(values.pop()) == KWARGS
    assert manifests.template_hash(fleets[0]) == manifests.template_hash(fleets[1])
    flipped = parse_fleet(mutated("proxy.chatTemplateKwargs", {**KWARGS, "enable_thinking": True}))
    assert manifests.template_hash(flipped) != manifests.template_hash(fleets[0])
    # A list's order is data, not layout: it is kept, and changing it is a change.
    tools = {"strict": True, "order": [1, 2]}
    swapped = parse_fleet(mutated("proxy.chatTemplateKwargs", {**KWARGS, "tools": tools}))
    assert manifests.template_hash(swapped) != manifests.template_hash(fleets[0])


def test_chat_formats_are_template_settings():
    assert not CHAT_FORMAT_ENV & manifests.HASH_EXEMPT_ENV
