"""The fleet's status, written with server-side apply on the status subresource: each writer applies
only the fields it owns, under its own field manager, and never reads to write.

- `rolloutfleet-reconciler` owns observedGeneration, the replica counts, selector, URLs and
  endpoints, and the conditions of `conditions.FLEET_CONDITION_TYPES` and ProxiesLost
  (lost_proxies.py);
- `rolloutfleet-memory-watchdog` owns memoryRestarts and the conditions MemoryPressure and
  StorageWritable.

`status.conditions` is a list-map keyed by `type` in the CRD, so the API server merges each
manager's entries by type: neither writer can erase the other's, whatever its cache held, and no
resourceVersion (nor a read after a conflict) is needed. A manager that applies without a field it
applied before gives it up, and the server removes it: so each writer applies all its fields every
time. A write happens only when an owned field differs from the cached fleet's: a fleet at rest
costs none.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from .fleet import API_VERSION, KIND
from .kubeapi import KubeApi
from .watch_cache import FleetStore

RECONCILER_MANAGER = "rolloutfleet-reconciler"
WATCHDOG_MANAGER = "rolloutfleet-memory-watchdog"

Call = Callable[..., Awaitable[Any]]


def owned_fields_differ(stored: Mapping[str, Any], owned: Mapping[str, Any]) -> bool:
    """Whether applying `owned` would change `stored` (a status): a field differs, or a condition of
    an owned type differs from the stored one of that type. Pure."""
    for key, value in owned.items():
        if key != "conditions":
            if stored.get(key) != value:
                return True
            continue
        by_type = {c.get("type"): c for c in stored.get("conditions") or ()}
        if any(by_type.get(c["type"]) != c for c in value):
            return True
    return False


def status_patch(namespace: str, name: str, owned: Mapping[str, Any]) -> dict[str, Any]:
    """The apply configuration: the object's identity and the owned status fields only."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name, "namespace": namespace},
        "status": dict(owned),
    }


async def apply_status(
    call: Call,
    fleets: FleetStore,
    namespace: str,
    name: str,
    field_manager: str,
    owned_for: Callable[[Mapping[str, Any]], Mapping[str, Any]],
) -> bool:
    """Apply `owned_for(status as cached)` as `field_manager` when it differs from the cached
    status; whether it wrote. `owned_for` receives the cached status to keep lastTransitionTimes.
    The answer (the fleet as stored) goes into the cache. `call(fn, *args)` runs `fn(api, *args)`
    in a worker thread."""
    current = fleets.get(namespace, name)
    if current is None:
        return False  # deleted: its children go with it
    stored = current.get("status") or {}
    owned = owned_for(stored)
    if not owned_fields_differ(stored, owned):
        return False
    answer = await call(_apply, status_patch(namespace, name, owned), field_manager)
    if answer is not None:
        fleets.put(answer)
    return answer is not None


def _apply(api: KubeApi, body: dict[str, Any], field_manager: str) -> dict | None:
    return api.apply_status(body, field_manager)
