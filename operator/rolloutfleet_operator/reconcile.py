"""One reconciliation pass of a RolloutFleet: observe, diff against the pure builders, apply.

Level-triggered: create, update, resume, a timer and pod events all run the same pass, and a pass
that finds the world as wanted writes nothing (server-side apply of unchanged children is a no-op,
and status is patched only when it differs). Every blocking API call runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import secrets
from dataclasses import dataclass, field
from typing import Any

from kubernetes.client.exceptions import ApiException

from .conditions import ObservedState, fleet_status
from .fleet import Fleet, engine_name, gateway_name, parse_fleet, proxy_ordinal, selector_string
from .kubeapi import KubeApi, resource_path
from .manifests import admin_key_secret, desired_children, proxy_pod, template_hash
from .plan import plan_proxies, proxy_pod_view

log = logging.getLogger("rolloutfleet.operator")


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class PassResult:
    """What one pass did, for Events and logs."""

    created: list[str] = field(default_factory=list)
    deleted: list[tuple[str, str]] = field(default_factory=list)  # (pod, reason)
    failures: list[str] = field(default_factory=list)
    status_changed: bool = False


class Reconciler:
    def __init__(self, api: KubeApi):
        self.api = api

    async def _call(self, fn, *args, **kwargs):
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def reconcile(self, body: dict[str, Any]) -> PassResult:
        fleet = parse_fleet(body)
        result = PassResult()
        for manifest in desired_children(fleet):
            await self._call(self.api.apply, manifest)
        if fleet.generates_admin_key:
            await self._ensure_admin_key(fleet)
        observed = await self._reconcile_proxies(fleet, result)
        status = fleet_status(
            fleet, observed, now_rfc3339(), (body.get("status") or {}).get("conditions") or []
        )
        if _status_differs(body.get("status") or {}, status):
            path = (
                resource_path("rolloutfleet.dev/v1alpha1", "RolloutFleet", fleet.namespace, fleet.name)
                + "/status"
            )
            await self._call(self.api.patch, path, {"status": status})
            result.status_changed = True
        return result

    async def _ensure_admin_key(self, fleet: Fleet) -> None:
        ref = fleet.admin_key_ref
        path = resource_path("v1", "Secret", fleet.namespace, ref.name)
        if await self._call(self.api.get, path) is None:
            # Created once with a random key and never re-applied (that would change the key).
            await self._call(
                self.api.create,
                resource_path("v1", "Secret", fleet.namespace),
                admin_key_secret(fleet, secrets.token_urlsafe(32)),
            )

    async def _reconcile_proxies(self, fleet: Fleet, result: PassResult) -> ObservedState:
        pods = await self._call(self.api.list, "v1", "Pod", fleet.namespace, selector_string(fleet, "proxy"))
        views = []
        for pod in pods:
            ordinal = proxy_ordinal(fleet, pod["metadata"]["name"])
            if ordinal is not None:
                views.append(proxy_pod_view(pod, ordinal))
        current = template_hash(fleet)
        plan = plan_proxies(fleet.proxy.replicas, views, current)
        failures: list[str] = []
        for ordinal in plan.create:
            manifest = proxy_pod(fleet, ordinal)
            try:
                created = await self._call(
                    self.api.create, resource_path("v1", "Pod", fleet.namespace), manifest
                )
            except ApiException as exc:
                failures.append(f"{manifest['metadata']['name']}: {exc.reason}")
                continue
            if created is not None:
                result.created.append(manifest["metadata"]["name"])
        for deletion in plan.delete:
            # Graceful: the pod's own terminationGracePeriodSeconds lets the proxy drain and dump.
            if await self._call(self.api.delete, resource_path("v1", "Pod", fleet.namespace, deletion.name)):
                result.deleted.append((deletion.name, deletion.reason))
        if plan.waiting:
            log.info("fleet %s/%s: %s", fleet.namespace, fleet.name, plan.waiting)
        result.failures = failures
        gateway = await self._call(
            self.api.get, resource_path("apps/v1", "Deployment", fleet.namespace, gateway_name(fleet))
        )
        engines = None
        if fleet.engines is not None:
            engines = await self._call(
                self.api.get, resource_path("apps/v1", "Deployment", fleet.namespace, engine_name(fleet))
            )
        return ObservedState(
            desired_proxies=fleet.proxy.replicas,
            proxies=tuple(views),
            current_hash=current,
            gateway_ready=_ready(gateway),
            gateway_desired=fleet.gateway.replicas,
            engines_ready=None if fleet.engines is None else _ready(engines),
            engines_desired=None if fleet.engines is None else fleet.engines.replicas,
            create_failures=tuple(failures),
        )


def _ready(deployment: dict | None) -> int:
    return int(((deployment or {}).get("status") or {}).get("readyReplicas") or 0)


def _status_differs(previous: dict[str, Any], new: dict[str, Any]) -> bool:
    """Compare only the fields this pass writes (the watchdog owns others, e.g. memoryRestarts)."""
    return any(previous.get(key) != value for key, value in new.items())
