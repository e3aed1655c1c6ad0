"""What the operator reads instead of asking the API server: the objects its watches delivered.

- Fleets: `FleetStore`, the latest body of each fleet, fed by the fleets' watch events and by the
  answers to the operator's own status writes (which are newer than any event already received).
- Children and their pods: kopf indexes (`OwnedObjects`), one per kind, over the objects labelled
  `app.kubernetes.io/managed-by=rolloutfleet-operator` (the API server filters by that label),
  grouped by namespace and the `rolloutfleet.dev/fleet` label. kopf fills every index from its
  initial listing before it runs any handler, so the first pass after a start never sees an empty
  cluster that is not empty.

A cache can lag the API server by a watch event. Writes are idempotent or scoped to what their
writer owns (apply, status applied per field manager, create of a name, delete of a uid), so a
stale read costs at most one redundant request.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .fleet import COMPONENT_LABEL, FLEET_LABEL, MANAGED_BY_LABEL, MANAGER

Key = tuple[str, str]  # (namespace, fleet name)
KindKey = tuple[str, str]  # (apiVersion, kind)

# The kinds the operator reads from its watches: every kind of child, and pods (its proxy pods, and
# the engine pods whose addresses go into status.engineEndpoints).
CACHED_KINDS: tuple[KindKey, ...] = (
    ("v1", "Pod"),
    ("v1", "Service"),
    ("v1", "ServiceAccount"),
    ("apps/v1", "Deployment"),
    ("policy/v1", "PodDisruptionBudget"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
    ("rbac.authorization.k8s.io/v1", "Role"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"),
)
OWNED_LABELS = {MANAGED_BY_LABEL: MANAGER}


def index_id(kind: KindKey) -> str:
    """The kopf index's id, which is also the keyword its handlers receive it under."""
    return f"owned_{kind[1].lower()}s"


def by_fleet(body: Mapping[str, Any]) -> dict[Key, dict[str, Any]]:
    """The index entry of an owned object: keyed by its fleet (nothing without a fleet label)."""
    metadata = body.get("metadata") or {}
    fleet = (metadata.get("labels") or {}).get(FLEET_LABEL)
    if not fleet:
        return {}
    return {(metadata.get("namespace") or "", fleet): dict(body)}


class OwnedObjects:
    """Read access to the indexes: kind -> {(namespace, fleet): objects of that fleet}."""

    def __init__(self, indexes: Mapping[KindKey, Mapping[Key, Iterable[Mapping[str, Any]]]]):
        self._indexes = indexes

    def of_fleet(
        self, kind: KindKey, namespace: str, fleet: str, component: str | None = None
    ) -> list[dict[str, Any]]:
        # kopf's Index is a Mapping whose missing keys raise: hence .get.
        objects = self._indexes[kind].get((namespace, fleet), ())
        return [dict(o) for o in objects if component is None or _component(o) == component]

    def get(self, kind: KindKey, namespace: str, fleet: str, name: str) -> dict[str, Any] | None:
        for obj in self.of_fleet(kind, namespace, fleet):
            if (obj.get("metadata") or {}).get("name") == name:
                return obj
        return None


def _component(obj: Mapping[str, Any]) -> str | None:
    return ((obj.get("metadata") or {}).get("labels") or {}).get(COMPONENT_LABEL)


class FleetStore:
    """The latest known body of each fleet, and the newest spec acted on."""

    def __init__(self) -> None:
        self._bodies: dict[Key, dict[str, Any]] = {}
        self._acted: dict[Key, tuple[str, int]] = {}  # (uid, generation) last acted on

    def put(self, body: Mapping[str, Any]) -> None:
        """A watch event's body, or the answer to a write (the object as stored after it)."""
        meta = body["metadata"]
        self._bodies[(meta["namespace"], meta["name"])] = dict(body)

    def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._bodies.get((namespace, name))

    def forget(self, namespace: str, name: str) -> None:
        self._bodies.pop((namespace, name), None)
        self._acted.pop((namespace, name), None)

    def to_act_on(
        self, namespace: str, name: str, given: Mapping[str, Any] | None = None
    ) -> dict[str, Any] | None:
        """The body a pass or a watchdog cycle acts on, asked for once it holds the fleet's lock:
        the newer of `given` (the body it was started with, which may be older than what arrived
        while it waited) and the cached one; None when that spec is older than one already acted on
        (a late event) or there is none. Recorded as acted on."""
        key = (namespace, name)
        body = newest_body(given, self._bodies.get(key))
        if body is None:
            return None
        uid, generation = _spec_of(body)
        acted = self._acted.get(key)
        if acted is not None and acted[0] == uid and generation < acted[1]:
            return None
        self._acted[key] = (uid, generation)
        return body

    def __contains__(self, key: object) -> bool:
        return key in self._bodies


def _spec_of(body: Mapping[str, Any]) -> tuple[str, int]:
    meta = body.get("metadata") or {}
    return str(meta.get("uid") or ""), int(meta.get("generation") or 0)


def newest_body(given: Mapping[str, Any] | None, cached: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Of two bodies of one fleet, the one to act on: the cached one (fed by the watch and by the
    answers to status writes) unless `given` is of the same object (uid) with a newer spec
    (generation). Another uid in the cache is the fleet as it now exists (deleted and created again)."""
    if cached is None or given is None:
        chosen = cached if given is None else given
        return dict(chosen) if chosen is not None else None
    given_uid, given_generation = _spec_of(given)
    cached_uid, cached_generation = _spec_of(cached)
    if given_uid == cached_uid and given_generation > cached_generation:
        return dict(given)
    return dict(cached)
