"""The settings contract between the operator and the proxy: which proxy settings the operator
injects into proxy pods, and the environment variables that carry them.

The proxy's settings model (rolloutfleet_proxy.settings) must have a field for every name here and
refuses to import otherwise; the operator names the variables from here, never from the proxy.
"""

from __future__ import annotations

from enum import StrEnum

ENV_PREFIX = "ROLLOUTFLEET_PROXY_"


class InjectedSetting(StrEnum):
    """Proxy settings the operator sets from a RolloutFleet's spec (docs/operator.md lists them)."""

    ADMIN_KEY = "admin_key"
    CHAT_TEMPLATE_KWARGS = "chat_template_kwargs"
    CLEANUP_INTERVAL_S = "cleanup_interval_s"
    DRAIN_GRACE_S = "drain_grace_s"
    DUMP_DIR = "dump_dir"
    DURABILITY = "durability"
    ENGINE_LOGPROBS = "engine_logprobs"
    EXPORT_TTL_S = "export_ttl_s"
    MAX_CONCURRENT_SESSIONS = "max_concurrent_sessions"
    MAX_STALENESS = "max_staleness"
    PUBLIC_URL = "public_url"
    REASONING_PARSER = "reasoning_parser"
    RSS_SOFT_LIMIT_BYTES = "rss_soft_limit_bytes"
    STALE_SESSION_TIMEOUT_S = "stale_session_timeout_s"
    STALENESS_BATCH_SHARE = "staleness_batch_share"
    TOKENIZER_PATH = "tokenizer_path"
    TOOL_CALL_PARSER = "tool_call_parser"
    UPSTREAM_URL = "upstream_url"


def env_var_name(setting: str) -> str:
    """The environment variable of a proxy setting (ROLLOUTFLEET_PROXY_<NAME>)."""
    return ENV_PREFIX + setting.upper()


# Setting name → variable, for the operator's manifest builders.
INJECTED_ENV: dict[str, str] = {setting.value: env_var_name(setting) for setting in InjectedSetting}
