"""The proxy settings the operator injects into a proxy pod, as environment variables: one per
entry of the shared table (`rolloutfleet_wire.proxy_settings.INJECTED_SETTINGS`), in its order,
followed by the spec's own `proxy.env` (whose entries replace injected ones of the same name).

The table says where each value comes from: a spec path, read here from the fleet, or a value the
operator derives (`derived_values`: the only settings this module names).
"""

from __future__ import annotations

import copy
from typing import Any

from rolloutfleet_wire.proxy_settings import INJECTED_SETTINGS, InjectedSetting

from ..fleet import Fleet, gateway_url
from .metadata import Manifest
from .pods import with_overrides

# Settings that follow the fleet's scale or budget, outside the template hash (see the table).
HASH_EXEMPT_ENV = frozenset(s.env_name for s in INJECTED_SETTINGS if not s.in_template_hash)


def derived_values(fleet: Fleet, pod_name: str, public_url: str) -> dict[str, Any]:
    """The values of the settings the table gives no spec path for, by setting name."""
    proxy = fleet.proxy
    return {
        "upstream_url": gateway_url(fleet),
        "dump_dir": f"{proxy.dump.path.rstrip('/')}/{pod_name}",
        "public_url": public_url,
        "staleness_batch_share": proxy.admission.batch_share(proxy.replicas),
        "rss_soft_limit_bytes": proxy.memory.soft_limit_bytes,
        "admin_key": fleet.admin_key_ref,
    }


def _env_entry(setting: InjectedSetting, value: Any) -> Manifest | None:
    if setting.secret:
        ref = {"name": value.name, "key": value.key}
        return {"name": setting.env_name, "valueFrom": {"secretKeyRef": ref}}
    text = setting.to_env(value)
    return None if text is None else {"name": setting.env_name, "value": text}


def proxy_env(fleet: Fleet, pod_name: str, public_url: str) -> list[Manifest]:
    derived = derived_values(fleet, pod_name, public_url)
    injected = []
    for setting in INJECTED_SETTINGS:
        value = derived[setting.name] if setting.spec_path is None else fleet.spec_value(setting.spec_path)
        entry = _env_entry(setting, copy.deepcopy(value))
        if entry is not None:
            injected.append(entry)
    return with_overrides(injected, fleet.proxy.env)
