"""One reconciliation pass of a RolloutFleet: observe, diff against the pure builders, apply.

Level-triggered: create, update, resume, a timer and pod events all run the same pass. It reads
what exists from the watch caches (watch_cache.py), not from the API server, and writes only what
differs: a child whose cached object already matches its desired manifest is not applied
(desired_state.py), unwanted children are looked for only when the spec changed, the generated
admin-key Secret is checked once per fleet, and status is applied only when it differs. So a pass
over a fleet at rest makes no API request at all. Every blocking API call runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import random
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kubernetes.client.exceptions import ApiException

from . import metrics
from .conditions import AVAILABLE, READY, ObservedState, deployment_available, fleet_status
from .desired_state import apply_reason, with_desired_hash
from .fleet import Fleet, engine_name, gateway_name, parse_fleet, proxy_ordinal
from .kubeapi import KubeApi, resource_path
from .manifests.admin_key import admin_key_secret
from .manifests.children import desired_children, unwanted_children
from .manifests.proxy_pod import proxy_pod, template_hash
from .pacing import Refused, refused_again
from .plan import VOLUNTARY_DISRUPTIONS, ProxyPodView, plan_proxies, proxy_pod_view, ready_pod_urls
from .pod_problems import PodProblem, mount_failures, pod_problem, waiting_to_mount
from .status_apply import RECONCILER_MANAGER, apply_status
from .watch_cache import FleetStore, OwnedObjects

log = logging.getLogger("rolloutfleet.operator")
POD = ("v1", "Pod")
DEPLOYMENT = ("apps/v1", "Deployment")
MOUNT_EVENTS_SELECTOR = "involvedObject.kind=Pod,reason=FailedMount"


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
    def __init__(self, api: KubeApi, fleets: FleetStore, owned: OwnedObjects):
        self.api = api
        self.fleets = fleets
        self.owned = owned
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        # Per fleet, the admin-key Secret (name, fleet uid) seen or created: checked once, as the
        # operator does not watch Secrets (its role may only get and create them).
        self._admin_keys: dict[tuple[str, str], tuple[str, str]] = {}
        # (uid, generation) of the spec whose unwanted children were last removed, per fleet.
        self._pruned: dict[tuple[str, str], tuple[str, int]] = {}
        # Proxy pods the API server refused to create, per (namespace, fleet, ordinal): retried
        # with backoff (pacing.py), not on every pass a pod event runs.
        self._refused: dict[tuple[str, str, int], Refused] = {}

    def lock_for(self, namespace: str, name: str) -> asyncio.Lock:
        """One pass or status write per fleet at a time: kopf runs the fleet's handlers, its timer,
        pod-triggered passes and the memory watchdog concurrently."""
        return self._locks.setdefault((namespace, name), asyncio.Lock())

    def forget(self, namespace: str, name: str) -> None:
        """The fleet is gone: drop what was remembered about it."""
        self._locks.pop((namespace, name), None)
        self._pruned.pop((namespace, name), None)
        self._admin_keys.pop((namespace, name), None)
        for key in [k for k in self._refused if k[:2] == (namespace, name)]:
            del self._refused[key]

    async def _call(self, fn, *args, **kwargs):
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def _call_api(self, fn, *args):
        """For apply_status: `fn(api, *args)` in a worker thread."""
        return await asyncio.to_thread(fn, self.api, *args)

    async def reconcile(self, body: dict[str, Any]) -> PassResult:
        fleet = parse_fleet(body)
        async with self.lock_for(fleet.namespace, fleet.name):
            return await self._reconcile(fleet)

    async def _reconcile(self, fleet: Fleet) -> PassResult:
        result = PassResult()
        for manifest in desired_children(fleet):
            kind = (manifest["apiVersion"], manifest["kind"])
            name = manifest["metadata"]["name"]
            child = f"{manifest['kind']}/{name}"
            desired = with_desired_hash(manifest)
            reason = apply_reason(desired, self.owned.get(kind, fleet.namespace, fleet.name, name))
            if reason is None:
                continue
            log.debug("fleet %s/%s: applying %s (%s)", fleet.namespace, fleet.name, child, reason)
            try:
                _, created = await self._call(self.api.apply_reporting, desired)
            except ApiException as exc:  # one refused child must not stop the others or the status
                result.failures.append(f"{child}: {_reason(exc)}")
                continue
            if created:
                result.created_children.append(child)
                metrics.CHILDREN_CREATED.labels(fleet.namespace, fleet.name, manifest["kind"]).inc()
        if fleet.generates_admin_key:
            await self._ensure_admin_key(fleet, result)
        spec = (fleet.uid, fleet.generation)
        if self._pruned.get((fleet.namespace, fleet.name)) != spec and await self._prune(fleet, result):
            self._pruned[(fleet.namespace, fleet.name)] = spec
        observed = await self._observe(fleet, await self._reconcile_proxies(fleet, result), result.failures)
        for state, count in (
            ("desired", fleet.proxy.replicas),
            ("ready", sum(1 for v in observed.proxies if v.ready)),
            ("updated", sum(1 for v in observed.proxies if v.template_hash == observed.current_hash)),
        ):
            metrics.FLEET_PROXIES.labels(fleet.namespace, fleet.name, state).set(count)

        def owned_for(stored: Mapping[str, Any]) -> dict[str, Any]:
            status = fleet_status(fleet, observed, now_rfc3339(), stored.get("conditions") or [])
            metrics.FLEET_READY.labels(fleet.namespace, fleet.name).set(
                any(c["type"] == READY and c["status"] == "True" for c in status["conditions"])
            )
            metrics.FLEET_AVAILABLE.labels(fleet.namespace, fleet.name).set(
                any(c["type"] == AVAILABLE and c["status"] == "True" for c in status["conditions"])
            )
            return status

        await apply_status(
            self._call_api, self.fleets, fleet.namespace, fleet.name, RECONCILER_MANAGER, owned_for
        )
        return result

    async def _prune(self, fleet: Fleet, result: PassResult) -> bool:
        """Delete children the spec no longer wants, when this fleet owns them (never another's);
        whether all of them are gone. The cache says which exist, so this costs no request unless
        there is something to delete."""
        done = True
        for api_version, kind, name in unwanted_children(fleet):
            child = self.owned.get((api_version, kind), fleet.namespace, fleet.name, name)
            owners = ((child or {}).get("metadata") or {}).get("ownerReferences") or []
            if child is None or not any(o.get("uid") == fleet.uid for o in owners):
                continue
            try:
                if await self._call(self.api.delete, resource_path(api_version, kind, fleet.namespace, name)):
                    result.deleted_children.append(f"{kind}/{name}")
            except ApiException as exc:
                result.failures.append(f"{kind}/{name}: {_reason(exc)}")
                done = False
        return done

    async def _ensure_admin_key(self, fleet: Fleet, result: PassResult) -> None:
        ref = fleet.admin_key_ref
        remembered = (ref.name, fleet.uid)
        if self._admin_keys.get((fleet.namespace, fleet.name)) == remembered:
            return
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
        self._admin_keys[(fleet.namespace, fleet.name)] = remembered

    def _proxy_views(self, fleet: Fleet) -> list[ProxyPodView]:
        views = []
        for pod in self.owned.of_fleet(POD, fleet.namespace, fleet.name, "proxy"):
            ordinal = proxy_ordinal(fleet, pod["metadata"]["name"])
            if ordinal is not None:
                views.append(proxy_pod_view(pod, ordinal))
        return views

    async def _reconcile_proxies(self, fleet: Fleet, result: PassResult) -> list[ProxyPodView]:
        views = self._proxy_views(fleet)
        current = template_hash(fleet)
        plan = plan_proxies(fleet.proxy.replicas, views, current)
        failures = result.failures
        for ordinal in plan.create:
            manifest = proxy_pod(fleet, ordinal)
            key = (fleet.namespace, fleet.name, ordinal)
            refused = self._refused.get(key)
            if refused is not None and refused.waiting(time.monotonic()):
                failures.append(refused.message)  # still reported, not asked again yet
                continue
            try:
                created = await self._call(
                    self.api.create, resource_path("v1", "Pod", fleet.namespace), manifest
                )
            except ApiException as exc:
                message = f"Pod/{manifest['metadata']['name']}: {_reason(exc)}"
                self._refused[key] = refused_again(refused, time.monotonic(), random.random(), message)
                failures.append(message)
                continue
            self._refused.pop(key, None)
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
        return views

    async def _observe(self, fleet: Fleet, views: list[ProxyPodView], failures: list[str]) -> ObservedState:
        """What the status is computed from; the pods as they were when this pass planned (its own
        creations and deletions show in the next pass, which their watch events trigger)."""
        gateway = self.owned.get(DEPLOYMENT, fleet.namespace, fleet.name, gateway_name(fleet))
        gateway_pods = self.owned.of_fleet(POD, fleet.namespace, fleet.name, "gateway")
        engines = None
        engine_pods: list[dict[str, Any]] = []
        engine_endpoints = fleet.external_engine_urls
        if fleet.engines is not None:
            engines = self.owned.get(DEPLOYMENT, fleet.namespace, fleet.name, engine_name(fleet))
            engine_pods = self.owned.of_fleet(POD, fleet.namespace, fleet.name, "engine")
            engine_endpoints = tuple(ready_pod_urls(engine_pods, fleet.engines.port))
        proxy_pods = self.owned.of_fleet(POD, fleet.namespace, fleet.name, "proxy")
        mounts = await self._mount_failures(fleet, [*proxy_pods, *gateway_pods, *engine_pods])
        return ObservedState(
            desired_proxies=fleet.proxy.replicas,
            proxies=tuple(replace(v, problem=mounts.get(v.name, v.problem)) for v in views),
            current_hash=template_hash(fleet),
            gateway_ready=_ready(gateway),
            gateway_desired=fleet.gateway.replicas,
            engines_ready=None if fleet.engines is None else _ready(engines),
            engines_desired=None if fleet.engines is None else fleet.engines.replicas,
            create_failures=tuple(failures),
            engine_endpoints=tuple(engine_endpoints),
            max_unavailable=fleet.proxy.memory.max_unavailable,
            gateway_available=deployment_available(gateway),
            gateway_problems=_problems(gateway_pods, mounts),
            engine_problems=_problems(engine_pods, mounts),
        )

    async def _mount_failures(self, fleet: Fleet, pods: list[dict[str, Any]]) -> dict[str, PodProblem]:
        """The kubelet's FailedMount Events of pods that still wait for their volumes: one LIST of
        the namespace's FailedMount Events, made only while such a pod exists (never at rest)."""
        now = datetime.datetime.now(datetime.UTC)
        waiting = [p["metadata"]["name"] for p in pods if waiting_to_mount(p, now)]
        if not waiting:
            return {}
        try:
            events = await self._call(
                self.api.list, "v1", "Event", fleet.namespace, None, MOUNT_EVENTS_SELECTOR
            )
        except ApiException as exc:  # no cause is worse than a failed pass: the pods show as not ready
            log.warning(
                "fleet %s/%s: listing FailedMount Events: %s", fleet.namespace, fleet.name, _reason(exc)
            )
            return {}
        return mount_failures(events, waiting)


def _problems(pods: list[dict[str, Any]], mounts: Mapping[str, PodProblem]) -> tuple[PodProblem, ...]:
    """Why these pods (a Deployment's) do not serve, by pod name."""
    found = []
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        problem = mounts.get(pod["metadata"]["name"]) or pod_problem(pod)
        if problem is not None:
            found.append(problem)
    return tuple(found)


def _reason(exc: ApiException) -> str:
    """The API server's message for a refused request (its Status body), else the HTTP reason."""
    try:
        return json.loads(exc.body or "{}").get("message") or str(exc.reason)
    except (ValueError, AttributeError):
        return str(exc.reason)


def _ready(deployment: dict | None) -> int:
    return int(((deployment or {}).get("status") or {}).get("readyReplicas") or 0)
