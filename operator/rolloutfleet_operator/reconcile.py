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
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kubernetes.client.exceptions import ApiException

from . import metrics
from .conditions import AVAILABLE, READY, ObservedState, condition_entry, deployment_available, fleet_status
from .desired_state import apply_reason, with_desired_hash
from .fleet import Fleet, engine_name, gateway_name, parse_fleet, selector_string
from .kubeapi import STRATEGIC, KubeApi, resource_path
from .lost_proxies import LostProxy, lost_condition, lost_proxies, nodes_to_check
from .manifests.admin_key import admin_key_secret
from .manifests.children import desired_children, unwanted_children
from .manifests.proxy_pod import proxy_pod, template_hash
from .ownership import ProxyClaim, adoption_patch, claim_proxy_pods, proxy_views
from .pacing import Refused, refused_again
from .plan import VOLUNTARY_DISRUPTIONS, Plan, ProxyPodView, plan_proxies, ready_pod_urls
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
    adopted: list[str] = field(default_factory=list)  # orphaned proxy pods given the fleet's ownerReference
    lost: list[LostProxy] = field(default_factory=list)  # proxies that became lost with their node
    force_deleted: list[LostProxy] = field(default_factory=list)
    stale: bool = False  # skipped: its spec was older than one already acted on


async def fresh_proxy_pods(call: Callable[..., Any], api: KubeApi, fleet: Fleet) -> ProxyClaim:
    """The fleet's proxy pods read from the API server now (a quorum read, not the watch cache):
    what a voluntary disruption (a roll step, a memory restart) is decided from, under the fleet's
    lock, so it counts the proxies down as they are, not as a lagging cache shows them."""
    pods = await call(api.list, "v1", "Pod", fleet.namespace, selector_string(fleet, "proxy"))
    return claim_proxy_pods(fleet, pods)


class Reconciler:
    def __init__(
        self,
        api: KubeApi,
        fleets: FleetStore,
        owned: OwnedObjects,
        wall_clock: Callable[[], float] = time.time,
    ):
        self.api = api
        self.fleets = fleets
        self.owned = owned
        self._wall_clock = wall_clock  # epoch seconds, compared with pods' deletionTimestamps
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        # Per fleet, the admin-key Secret (name, fleet uid) seen or created: checked once, as the
        # operator does not watch Secrets (its role may only get and create them).
        self._admin_keys: dict[tuple[str, str], tuple[str, str]] = {}
        # (uid, generation) of the spec whose unwanted children were last removed, per fleet.
        self._pruned: dict[tuple[str, str], tuple[str, int]] = {}
        # Proxy pods the API server refused to create, per (namespace, fleet, ordinal): retried
        # with backoff (pacing.py), not on every pass a pod event runs.
        self._refused: dict[tuple[str, str, int], Refused] = {}
        # Per fleet, the uids of the proxies reported lost (a ProxyLost Event once per pod).
        self._lost: dict[tuple[str, str], set[str]] = {}

    def lock_for(self, namespace: str, name: str) -> asyncio.Lock:
        """One pass or status write per fleet at a time: kopf runs the fleet's handlers, its timer,
        pod-triggered passes and the memory watchdog concurrently."""
        return self._locks.setdefault((namespace, name), asyncio.Lock())

    def forget(self, namespace: str, name: str) -> None:
        """The fleet is gone: drop what was remembered about it."""
        self._locks.pop((namespace, name), None)
        self._pruned.pop((namespace, name), None)
        self._admin_keys.pop((namespace, name), None)
        self._lost.pop((namespace, name), None)
        for key in [k for k in self._refused if k[:2] == (namespace, name)]:
            del self._refused[key]

    async def _call(self, fn, *args, **kwargs):
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def _call_api(self, fn, *args):
        """For apply_status: `fn(api, *args)` in a worker thread."""
        return await asyncio.to_thread(fn, self.api, *args)

    async def reconcile(self, body: dict[str, Any]) -> PassResult:
        """One pass, on the newest spec known once the fleet's lock is taken (`body` may have
        waited for the lock while a newer one arrived); skipped when that spec is older than one a
        pass or the watchdog already acted on."""
        namespace, name = body["metadata"].get("namespace") or "default", body["metadata"]["name"]
        async with self.lock_for(namespace, name):
            current = self.fleets.to_act_on(namespace, name, body)
            if current is None:
                log.info("fleet %s/%s: skipping a pass on an older spec", namespace, name)
                return PassResult(stale=True)
            return await self._reconcile(parse_fleet(current))

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
        views, lost = await self._reconcile_proxies(fleet, result)
        observed = await self._observe(fleet, views, result.failures)
        still_lost = [p for p in lost if p not in result.force_deleted]
        for state, count in (
            ("desired", fleet.proxy.replicas),
            ("ready", sum(1 for v in observed.proxies if v.ready)),
            ("updated", sum(1 for v in observed.proxies if v.template_hash == observed.current_hash)),
        ):
            metrics.FLEET_PROXIES.labels(fleet.namespace, fleet.name, state).set(count)

        def owned_for(stored: Mapping[str, Any]) -> dict[str, Any]:
            now = now_rfc3339()
            status = fleet_status(fleet, observed, now, stored.get("conditions") or [])
            lost_now = lost_condition(still_lost, fleet.generation)
            status["conditions"].append(condition_entry(lost_now, stored.get("conditions") or [], now))
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

    async def _reconcile_proxies(
        self, fleet: Fleet, result: PassResult
    ) -> tuple[list[ProxyPodView], tuple[LostProxy, ...]]:
        claim = claim_proxy_pods(fleet, self.owned.of_fleet(POD, fleet.namespace, fleet.name, "proxy"))
        owned = list(claim.owned) + await self._adopt(fleet, claim.orphans, result)
        views = list(proxy_views(fleet, owned).values())
        lost = await self._handle_lost(fleet, views, result)
        current = template_hash(fleet)
        plan = plan_proxies(fleet.proxy.replicas, views, current)
        if any(d.reason in VOLUNTARY_DISRUPTIONS for d in plan.delete):
            # A Ready proxy taken down by choice: decided again from the pods as they are now.
            claim = await fresh_proxy_pods(self._call, self.api, fleet)
            views = list(proxy_views(fleet, claim.owned).values())
            plan = plan_proxies(fleet.proxy.replicas, views, current)
        uids = {view.name: view.uid for view in views}
        await self._carry_out(fleet, plan, uids, claim.foreign_names, result)
        return views, lost

    async def _adopt(self, fleet: Fleet, orphans: Iterable[Mapping[str, Any]], result: PassResult) -> list:
        """Give orphaned proxy pods the fleet's ownerReference (ownership.py); the pods adopted."""
        adopted = []
        for pod in orphans:
            name = pod["metadata"]["name"]
            path = resource_path("v1", "Pod", fleet.namespace, name)
            try:
                patched = await self._call(self.api.patch, path, adoption_patch(fleet, pod), STRATEGIC)
            except ApiException as exc:  # 409: the name now holds another pod; decided again next pass
                log.info("fleet %s/%s: not adopting %s: %s", fleet.namespace, fleet.name, name, _reason(exc))
                continue
            if patched is not None:
                adopted.append(patched)
                result.adopted.append(name)
        return adopted

    async def _handle_lost(
        self, fleet: Fleet, views: list[ProxyPodView], result: PassResult
    ) -> tuple[LostProxy, ...]:
        """Proxies stuck terminating on a lost node (lost_proxies.py): reported when they become
        lost, force-deleted once their timeout is over. Reads a Node only while a proxy is
        terminating past its grace period."""
        key = (fleet.namespace, fleet.name)
        now = self._wall_clock()
        nodes: dict[str, dict | None] = {}
        for node in sorted(nodes_to_check(views, now)):
            try:
                nodes[node] = await self._call(self.api.get, f"/api/v1/nodes/{node}")
            except ApiException as exc:  # e.g. a chart without the nodes rule: not judged
                log.warning("fleet %s/%s: cannot read node %s: %s", *key, node, _reason(exc))
        lost = lost_proxies(views, nodes, now, fleet.proxy.lost_proxy_timeout_s)
        reported = self._lost.setdefault(key, set())
        result.lost = [p for p in lost if p.uid not in reported]
        self._lost[key] = {p.uid for p in lost}
        for proxy in lost:
            if not proxy.due(now):
                continue
            body = {"gracePeriodSeconds": 0, "preconditions": {"uid": proxy.uid}}
            path = resource_path("v1", "Pod", fleet.namespace, proxy.pod)
            try:
                deleted = await self._call(self.api.delete, path, body)
            except ApiException as exc:  # 409: already replaced under its name
                log.info("fleet %s/%s: not force-deleting %s: %s", *key, proxy.pod, _reason(exc))
                continue
            if deleted:
                result.force_deleted.append(proxy)
                metrics.PROXIES_DELETED.labels(fleet.namespace, fleet.name, "NodeLost").inc()
        return lost

    async def _carry_out(
        self, fleet: Fleet, plan: Plan, uids: Mapping[str, str], foreign: frozenset[str], result: PassResult
    ) -> None:
        failures = result.failures
        for ordinal in plan.create:
            manifest = proxy_pod(fleet, ordinal)
            name = manifest["metadata"]["name"]
            if name in foreign:  # an earlier fleet's pod, or another controller's: wait until it is gone
                failures.append(f"Pod/{name}: the name is held by a pod this fleet does not own")
                continue
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
                message = f"Pod/{name}: {_reason(exc)}"
                self._refused[key] = refused_again(refused, time.monotonic(), random.random(), message)
                failures.append(message)
                continue
            self._refused.pop(key, None)
            if created is not None:
                result.created.append(name)
                metrics.CHILDREN_CREATED.labels(fleet.namespace, fleet.name, "Pod").inc()
        for deletion in plan.delete:
            # Graceful: the pod's own terminationGracePeriodSeconds lets the proxy drain and dump.
            if deletion.reason in VOLUNTARY_DISRUPTIONS:
                # A Ready proxy taken down by choice goes through the Eviction API, so the fleet's
                # PodDisruptionBudget also covers node drains running at the same time.
                outcome = await self._call(
                    self.api.evict, fleet.namespace, deletion.name, uids.get(deletion.name)
                )
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
