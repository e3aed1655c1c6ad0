"""The settings contract between the operator and the proxy: one table of the proxy settings the
operator injects into proxy pods, each with where its value comes from in a RolloutFleet, the
environment variable that carries it, and how the value becomes the variable's text.

The proxy's settings model (rolloutfleet_proxy.settings) must have a field for every setting here
and refuses to import otherwise; the operator's builder (rolloutfleet_operator.manifests.proxy_env)
loops over the table and never names a setting from the spec. Adding one that comes from a spec
field: the field in crds/source/ (`./dev crd`), an entry here, the field in the proxy's settings.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

ENV_PREFIX = "ROLLOUTFLEET_PROXY_"


def env_var_name(setting: str) -> str:
    """The environment variable of a proxy setting (ROLLOUTFLEET_PROXY_<NAME>)."""
    return ENV_PREFIX + setting.upper()


# How a value becomes a variable's text; None: not injected, the proxy's own default applies.


def as_text(value: object) -> str | None:
    """A number, string or flag as the proxy's settings parse it (1800.0 -> "1800"); unset: None."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def above_zero(value: object) -> str | None:
    """A count whose 0 means "off" (the proxy's default): injected only above 0."""
    return as_text(value) if isinstance(value, int | float) and value > 0 else None


def when_on(value: object) -> str | None:
    """A flag whose off is the proxy's default: injected only when on (fleets that leave it off keep
    their pods' template, so adding the flag rolls no proxy)."""
    return "true" if value is True else None


def json_object(value: object) -> str | None:
    """An object as compact JSON with sorted keys, injected only when not empty: the same object
    always gives the same text, so the pod template's hash does not depend on the order the API
    returns its keys in."""
    return json.dumps(value, sort_keys=True, separators=(",", ":")) if value else None


@dataclass(frozen=True)
class InjectedSetting:
    """One proxy setting the operator injects.

    Its value is the fleet's `spec.<spec_path>` (the CRD's default where unset), or, without a
    spec path, one the operator derives from the fields in `derived_from` and the pod's identity.
    """

    name: str  # the proxy's settings field
    spec_path: str | None = None
    derived_from: tuple[str, ...] = ()  # paths under spec; documentation and tests check them
    to_env: Callable[[object], str | None] = as_text
    # A reference to a Secret key, injected as valueFrom.secretKeyRef (never as plain text).
    secret: bool = False
    # False for values that follow the fleet's scale or budget: changing replicas or the RSS budget
    # must not roll every proxy (a pod keeps what it was created with until it is replaced).
    in_template_hash: bool = True

    @property
    def env_name(self) -> str:
        return env_var_name(self.name)


# In the order the variables appear in the container's env (before the spec's own `proxy.env`).
INJECTED_SETTINGS: tuple[InjectedSetting, ...] = (
    InjectedSetting("upstream_url", derived_from=("gateway.port",)),  # the gateway Service's URL
    InjectedSetting("tokenizer_path", "proxy.tokenizer.path"),
    InjectedSetting("stale_session_timeout_s", "proxy.staleSessionTimeoutSeconds"),
    InjectedSetting("cleanup_interval_s", "proxy.cleanupIntervalSeconds"),
    InjectedSetting("dump_dir", derived_from=("proxy.dump.path",)),  # <path>/<pod name>
    InjectedSetting("durability", "proxy.dump.durability"),
    InjectedSetting("drain_grace_s", "proxy.drainGraceSeconds"),
    InjectedSetting("public_url", derived_from=("proxy.port",)),  # the pod's per-pod DNS name
    InjectedSetting("export_ttl_s", "proxy.exportTtlSeconds"),
    InjectedSetting("engine_logprobs", "proxy.engineLogprobs"),
    InjectedSetting("tool_call_parser", "proxy.toolCallParser"),
    InjectedSetting("reasoning_parser", "proxy.reasoningParser"),
    InjectedSetting("chat_template_kwargs", "proxy.chatTemplateKwargs", to_env=json_object),
    InjectedSetting("routed_experts", "proxy.routedExperts", to_env=when_on),
    InjectedSetting("max_staleness", "proxy.admission.maxStaleness"),
    InjectedSetting(
        "staleness_batch_share",
        derived_from=("proxy.admission.consumerBatchSize", "proxy.replicas"),
        in_template_hash=False,
    ),
    InjectedSetting("max_concurrent_sessions", "proxy.admission.maxConcurrentSessions", to_env=above_zero),
    InjectedSetting(
        "rss_soft_limit_bytes",
        derived_from=("proxy.memory.rssBudgetBytes", "proxy.memory.refuseNewSessionsPercent"),
        to_env=above_zero,
        in_template_hash=False,
    ),
    # The spec's Secret, or the one the operator generates.
    InjectedSetting("admin_key", derived_from=("proxy.adminKeySecret",), secret=True),
)
