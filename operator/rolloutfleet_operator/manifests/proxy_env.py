"""The proxy settings the operator injects into a proxy pod, as environment variables.

The variables are named by the shared contract (`rolloutfleet_wire.proxy_settings`), which the
proxy's settings model must satisfy, so the operator and the proxy cannot disagree on a name.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from rolloutfleet_wire.proxy_settings import INJECTED_ENV as ENV

from ..fleet import Fleet, gateway_url
from .metadata import Manifest
from .pods import with_overrides


def _setting(value: Any) -> str:
    """An environment variable's value for a number or string setting (1800.0 -> "1800")."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _env(name: str, value: Any) -> Manifest:
    return {"name": name, "value": _setting(value)}


def proxy_env(fleet: Fleet, pod_name: str, public_url: str) -> list[Manifest]:
    proxy = fleet.proxy
    secret = fleet.admin_key_ref
    injected = [
        _env(ENV["upstream_url"], gateway_url(fleet)),
        _env(ENV["tokenizer_path"], proxy.tokenizer.path),
        _env(ENV["stale_session_timeout_s"], proxy.stale_session_timeout_s),
        _env(ENV["cleanup_interval_s"], proxy.cleanup_interval_s),
        _env(ENV["dump_dir"], f"{proxy.dump.path.rstrip('/')}/{pod_name}"),
        _env(ENV["durability"], proxy.dump.durability),
        _env(ENV["drain_grace_s"], proxy.drain_grace_s),
        _env(ENV["public_url"], public_url),
        _env(ENV["export_ttl_s"], proxy.export_ttl_s),
        _env(ENV["engine_logprobs"], proxy.engine_logprobs),
        *_chat_format_env(fleet),
        *_runtime_tunable_env(fleet),
        {
            "name": ENV["admin_key"],
            "valueFrom": {"secretKeyRef": {"name": secret.name, "key": secret.key}},
        },
    ]
    return with_overrides(copy.deepcopy(injected), proxy.env)


def _chat_format_env(fleet: Fleet) -> list[Manifest]:
    """The served model's chat formats, each only when the spec sets it (else the proxy's default).
    The keywords are compact JSON with sorted keys: the same object always gives the same value, so
    the template hash does not depend on the order the API returns its keys in."""
    proxy = fleet.proxy
    env = []
    if proxy.tool_call_parser is not None:
        env.append(_env(ENV["tool_call_parser"], proxy.tool_call_parser))
    if proxy.reasoning_parser is not None:
        env.append(_env(ENV["reasoning_parser"], proxy.reasoning_parser))
    if proxy.chat_template_kwargs:
        kwargs = json.dumps(proxy.chat_template_kwargs, sort_keys=True, separators=(",", ":"))
        env.append({"name": ENV["chat_template_kwargs"], "value": kwargs})
    return env


# Settings that follow the fleet's scale or budget. They stay out of the template hash: changing
# replicas or the RSS budget must not roll every proxy. A pod keeps the values it was created with
# until it is replaced (admission and the soft limit are approximate for that while, not wrong).
HASH_EXEMPT_ENV = frozenset({ENV["staleness_batch_share"], ENV["rss_soft_limit_bytes"]})


def _runtime_tunable_env(fleet: Fleet) -> list[Manifest]:
    proxy = fleet.proxy
    admission = proxy.admission
    env = []
    if admission.max_staleness is not None:
        env.append(_env(ENV["max_staleness"], admission.max_staleness))
        env.append(_env(ENV["staleness_batch_share"], admission.batch_share(proxy.replicas)))
    if admission.max_concurrent_sessions > 0:
        env.append(_env(ENV["max_concurrent_sessions"], admission.max_concurrent_sessions))
    if proxy.memory.soft_limit_bytes > 0:
        env.append(_env(ENV["rss_soft_limit_bytes"], proxy.memory.soft_limit_bytes))
    return env
