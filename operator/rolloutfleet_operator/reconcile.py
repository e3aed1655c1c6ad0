"""One reconciliation pass of a RolloutFleet: observe, diff against the pure builders, apply.

Level-triggered: create, update, resume, a timer and pod events all run the same pass, and a pass
that finds the world as wanted writes nothing (server-side apply of unchanged children is a no-op,
and status is patched only when it differs). Every blocking API call runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import secrets
from dataclasses import dataclass, field
from typing import Any

from kubernetes.client.exceptions import ApiException

from . import metrics
from .conditions import ObservedState, fleet_status
from .fleet import Fleet, engine_name, gateway_name, parse_fleet, proxy_ordinal, selector_string
from .kubeapi import KubeApi, fleet_path, resource_path
from .manifests import admin_key_secret, desired_children, proxy_pod, template_hash, unwanted_children
from .plan import VOLUNTARY_DISRUPTIONS, plan_proxies, proxy_pod_view, ready_pod_urls

log = logging.getLogger("rolloutfleet.operator")


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class PassResult:
    """What one pass did, for Events and logs."""

    created: list[str] = field(default_factory=list)  # proxy pods
    created_children: list[str] = field(default_factory=list)  # "Kind/name" of other children
    deleted: list[tuple[str, str]] = field(default_factory=list)  # (pod, reason)
    deleted_children: list[str] = field(default_factory=list)  # "Kind/name" no longer wanted
    failures: list[str] = field(default_factory=list)


class Reconciler:
    def __init__(self, api: KubeApi):
        self.api = api
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}

    def lock_for(self, namespace: str, name: str) -> asyncio.Lock:
        """One pass or status write per fleet at a time: kopf runs the fleet's handlers, its timer,
        pod-triggered passes and the memory watchdog concurrently."""
        return self._locks.setdefault((namespace, name), asyncio.Lock())

    async def _call(self, fn, *args, **kwargs):
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def reconcile(self, body: dict[str, Any]) -> PassResult:
        fleet = parse_fleet(body)
        async with self.lock_for(fleet.namespace, fleet.name):
            return await self._reconcile(fleet, body)

    async def _reconcile(self, fleet: Fleet, body: dict[str, Any]) -> PassResult:
        result = PassResult()
        for manifest in desired_children(fleet):
            child = f"{manifest['kind']}/{manifest['metadata']['name']}"
            try:
                _, created = await self._call(self.api.apply_reporting, manifest)
            except ApiException as exc:  # one refused child must not stop the others or the status
                result.failures.append(f"{child}: {_reason(exc)}")
                continue
            if created:
                result.created_children.append(child)
                metrics.CHILDREN_CREATED.labels(fleet.namespace, fleet.name, manifest["kind"]).inc()
        if fleet.generates_admin_key:
            await self._ensure_admin_key(fleet, result)
        await self._prune(fleet, result)
        observed = await self._reconcile_proxies(fleet, result)
        for state, count in (
            ("desired", fleet.proxy.replicas),
            ("ready", sum(1 for v in observed.proxies if v.ready)),
            ("updated", sum(1 for v in observed.proxies if v.template_hash == observed.current_hash)),
        ):
            metrics.FLEET_PROXIES.labels(fleet.namespace, fleet.name, state).set(count)
        # The status as stored now, not as in `body`: the memory watchdog may have set its
        # condition since, and the conditions list is written whole.
        path = fleet_path(fleet.namespace, fleet.name)
        current = await self._call(self.api.get, path)
        if current is None:
            return result  # deleted meanwhile: its children go with it
        previous = current.get("status") or {}
        status = fleet_status(fleet, observed, now_rfc3339(), previous.get("conditions") or [])
        metrics.FLEET_READY.labels(fleet.namespace, fleet.name).set(
            any(c["type"] == "Ready" and c["status"] == "True" for c in status["conditions"])
        )
        if _status_differs(previous, status):
            await self._call(self.api.patch, path + "/status", {"status": status})
        return result

    async def _prune(self, fleet: Fleet, result: PassResult) -> None:
        """Delete children the spec no longer wants, when this fleet owns them (never another's)."""
        for api_version, kind, name in unwanted_children(fleet):
            path = resource_path(api_version, kind, fleet.namespace, name)
            child = await self._call(self.api.get, path)
            owners = ((child or {}).get("metadata") or {}).get("ownerReferences") or []
            owned = child is not None and any(o.get("uid") == fleet.uid for o in owners)
            if owned and await self._call(self.api.delete, path):
                result.deleted_children.append(f"{kind}/{name}")

    async def _ensure_admin_key(self, fleet: Fleet, result: PassResult) -> None:
        ref = fleet.admin_key_ref
        path = resource_path("v1", "Secret", fleet.namespace, ref.name)
        if await self._call(self.api.get, path) is None:
            # Created once with a random key and never re-applied (that would change the key).
            created = await self._call(
                self.api.create,
                resource_path("v1", "Secret", fleet.namespace),
                admin_key_secret(fleet, secrets.token_urlsafe(32)),
            )
            if created is not None:
                result.created_children.append(f"Secret/{ref.name}")
                metrics.CHILDREN_CREATED.labels(fleet.namespace, fleet.name, "Secret").inc()

    async def _reconcile_proxies(self, fleet: Fleet, result: PassResult) -> ObservedState:
        pods = await self._call(self.api.list, "v1", "Pod", fleet.namespace, selector_string(fleet, "proxy"))
        views = []
        for pod in pods:
            ordinal = proxy_ordinal(fleet, pod["metadata"]["name"])
            if ordinal is not None:
                views.append(proxy_pod_view(pod, ordinal))
        current = template_hash(fleet)
        plan = plan_proxies(fleet.proxy.replicas, views, current)
        failures = result.failures
        for ordinal in plan.create:
            manifest = proxy_pod(fleet, ordinal)
            try:
                created = await self._call(
                    self.api.create, resource_path("v1", "Pod", fleet.namespace), manifest
                )
            except ApiException as exc:
                failures.append(f"Pod/{manifest['metadata']['name']}: {_reason(exc)}")
                continue
            if created is not None:
                result.created.append(manifest["metadata"]["name"])
                metrics.CHILDREN_CREATED.labels(fleet.namespace, fleet.name, "Pod").inc()
        for deletion in plan.delete:
            # Graceful: the pod's own terminationGracePeriodSeconds lets the proxy drain and dump.
            if deletion.reason in VOLUNTARY_DISRUPTIONS:
                # A Ready proxy taken down by choice goes through the Eviction API, so the fleet's
                # PodDisruptionBudget also covers node drains running at the same time.
                outcome = await self._call(self.api.evict, fleet.namespace, deletion.name)
                if outcome == "refused":
                    log.info(
                        "fleet %s/%s: %s waits for its disruption budget",
                        fleet.namespace,
                        fleet.name,
                        deletion.name,
                    )
                gone = outcome == "evicted"
            else:
                gone = await self._call(
                    self.api.delete, resource_path("v1", "Pod", fleet.namespace, deletion.name)
                )
            if gone:
                result.deleted.append((deletion.name, deletion.reason))
                metrics.PROXIES_DELETED.labels(fleet.namespace, fleet.name, deletion.reason).inc()
        if plan.waiting:
            log.info("fleet %s/%s: %s", fleet.namespace, fleet.name, plan.waiting)
        gateway = await self._call(
            self.api.get, resource_path("apps/v1", "Deployment", fleet.namespace, gateway_name(fleet))
        )
        engines = None
        engine_endpoints = fleet.external_engine_urls
        if fleet.engines is not None:
            engines = await self._call(
                self.api.get, resource_path("apps/v1", "Deployment", fleet.namespace, engine_name(fleet))
            )
            engine_pods = await self._call(
                self.api.list, "v1", "Pod", fleet.namespace, selector_string(fleet, "engine")
            )
            engine_endpoints = tuple(ready_pod_urls(engine_pods or [], fleet.engines.port))
        return ObservedState(
            desired_proxies=fleet.proxy.replicas,
            proxies=tuple(views),
            current_hash=current,
            gateway_ready=_ready(gateway),
            gateway_desired=fleet.gateway.replicas,
            engines_ready=None if fleet.engines is None else _ready(engines),
            engines_desired=None if fleet.engines is None else fleet.engines.replicas,
            create_failures=tuple(failures),
            engine_endpoints=tuple(engine_endpoints),
        )


def _reason(exc: ApiException) -> str:
    """The API server's message for a refused request (its Status body), else the HTTP reason."""
    try:
        return json.loads(exc.body or "{}").get("message") or str(exc.reason)
    except (ValueError, AttributeError):
        return str(exc.reason)


def _ready(deployment: dict | None) -> int:
    return int(((deployment or {}).get("status") or {}).get("readyReplicas") or 0)


def _status_differs(previous: dict[str, Any], new: dict[str, Any]) -> bool:
    """Compare only the fields this pass writes (the watchdog owns others, e.g. memoryRestarts)."""
    return any(previous.get(key) != value for key, value in new.items())
