"""One fleet's memory watchdog: each cycle polls the proxies' /stats, decides (watchdog.py, pure) and
acts: graceful deletion of over-budget proxies, Events, metrics and the fleet's status.

API requests per cycle, whatever the fleet's size: none at rest (the pods and the fleet come from
the watch caches, watch_cache.py), one status apply (field manager `rolloutfleet-memory-watchdog`,
status_apply.py) when its conditions or memoryRestarts changed, plus one delete per restart. Polls
go straight to pod IPs, bounded in concurrency and time (stats_poll.py).

Storage is reported for every running proxy, Ready or not: a proxy whose dump volume refuses
writes fails /readyz on purpose, and still answers /stats. The last report of each pod is kept
until the pod is replaced, so a poll that fails meanwhile does not erase it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import aiohttp

from . import metrics, watchdog
from .conditions import condition_entry
from .fleet import Fleet, proxy_ordinal
from .kubeapi import KubeApi, resource_path
from .plan import ProxyPodView, proxy_pod_view
from .reconcile import POD
from .reconcile import now_rfc3339 as _now_rfc3339
from .stats_poll import poll_stats, stats_url
from .status_apply import WATCHDOG_MANAGER, apply_status
from .watch_cache import FleetStore, OwnedObjects

log = logging.getLogger("rolloutfleet.watchdog")

POLL_CONCURRENCY = 16
MAX_POLL_TIMEOUT_S = 5.0


class EventSink(Protocol):
    """events.EventRecorder.post_event: one Event per cause, counted."""

    async def __call__(self, obj: Mapping[str, Any], type: str, reason: str, message: str) -> None: ...


def poll_timeout(check_interval_s: float) -> float:
    """A poll never outlasts the cycle: at most half the interval, and 5 s."""
    return max(0.5, min(MAX_POLL_TIMEOUT_S, check_interval_s / 2))


def poll_targets(
    pods: list[dict[str, Any]], views: dict[str, ProxyPodView], port: int, ready: bool = True
) -> list[tuple[str, str]]:
    """(name, /stats URL) of the proxies worth polling, not terminating, with an IP: the Ready ones
    (memory and storage), or with `ready=False` the running ones that are not Ready (storage only:
    an unwritable proxy fails /readyz but answers /stats)."""
    targets = []
    for pod in pods:
        name = pod["metadata"]["name"]
        view = views.get(name)
        ip = (pod.get("status") or {}).get("podIP")
        if view is None or view.deleting or not ip:
            continue
        if view.ready == ready and (ready or view.phase == "Running"):
            targets.append((name, stats_url(ip, port)))
    return targets


class FleetWatchdog:
    """Kept per fleet for the operator's lifetime: the decision state lives here between cycles."""

    def __init__(
        self,
        api: KubeApi,
        fleets: FleetStore,
        owned: OwnedObjects,
        http: aiohttp.ClientSession,
        post_event: EventSink,
        status_lock: asyncio.Lock,
        clock: Callable[[], float] = time.monotonic,
        now_rfc3339: Callable[[], str] | None = None,
    ):
        self.api = api
        self.fleets = fleets
        self.owned = owned
        self.http = http
        self.post_event = post_event
        self.status_lock = status_lock  # shared with the reconciler: one status writer at a time
        self.state = watchdog.FleetMemoryState({})
        self._clock = clock
        self._now_rfc3339 = now_rfc3339 or _now_rfc3339
        self._seeded = False
        self._holds: dict[str, str] = {}  # pod -> last hold reason reported (Events on change only)
        self._requests = 0  # API requests in the current cycle
        self._rss_series: set[str] = set()  # pods with a PROXY_RSS series
        self._storage: dict[str, watchdog.StorageReport] = {}  # pod name -> its last storage report

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        self._requests += 1
        return await asyncio.to_thread(fn, *args)

    async def _call_api(self, fn: Callable[..., Any], *args: Any) -> Any:
        """For apply_status: `fn(api, *args)`, counted."""
        return await self._call(fn, self.api, *args)

    async def cycle(self, fleet: Fleet) -> None:
        self._requests = 0
        try:
            await self._cycle(fleet)
        finally:
            metrics.WATCHDOG_CYCLES.labels(fleet.namespace, fleet.name).inc()
            metrics.WATCHDOG_API_REQUESTS.labels(fleet.namespace, fleet.name).inc(self._requests)

    async def _cycle(self, fleet: Fleet) -> None:
        spec = fleet.proxy.memory
        metrics.PROXY_RSS_BUDGET.labels(fleet.namespace, fleet.name).set(spec.rss_budget_bytes)
        pods: list[dict[str, Any]] = []
        samples: dict[str, watchdog.Sample] = {}
        storage_samples: dict[str, watchdog.Sample] = {}
        if spec.enabled:  # off: no polls, only the conditions saying so
            pods = self.owned.of_fleet(POD, fleet.namespace, fleet.name, "proxy")
        by_name = {pod["metadata"]["name"]: pod for pod in pods}
        views = {}
        for name, pod in by_name.items():
            ordinal = proxy_ordinal(fleet, name)
            if ordinal is not None:
                views[name] = proxy_pod_view(pod, ordinal)
        if spec.enabled:
            targets = poll_targets(pods, views, fleet.proxy.port)
            metrics.WATCHDOG_POLLS.labels(fleet.namespace, fleet.name).inc(len(targets))
            not_ready = poll_targets(pods, views, fleet.proxy.port, ready=False)
            polled = await poll_stats(
                targets + not_ready,
                timeout_s=poll_timeout(spec.check_interval_s),
                concurrency=POLL_CONCURRENCY,
                session=self.http,
            )
            samples = {name: polled[name] for name, _ in targets if name in polled}
            storage_samples = polled
        uids = {name: pod["metadata"].get("uid", "") for name, pod in by_name.items()}
        self._storage = watchdog.storage_reports(self._storage, storage_samples, uids)
        self._record_samples(fleet, samples)
        now = self._clock()
        if not self._seeded:
            previous = self.fleets.get(fleet.namespace, fleet.name)
            memory_restarts = ((previous or {}).get("status") or {}).get("memoryRestarts")
            self.state = watchdog.seed_from_status(
                self.state, memory_restarts, now=now, wall_now=time.time(), spec=spec
            )
            self._seeded = True
        self.state = watchdog.observe(self.state, samples, now, spec)
        wanted = {f"{fleet.name}-proxy-{i}" for i in range(fleet.proxy.replicas)}
        self.state = watchdog.retain(self.state, wanted)
        decision = watchdog.decide(self.state, list(views.values()), now, spec, desired=fleet.proxy.replicas)
        metrics.PROXIES_IN_BACKOFF.labels(fleet.namespace, fleet.name).set(len(decision.in_backoff))
        restarts = []
        for restart in decision.restart:
            if await self._restart(fleet, by_name[restart.pod], restart):
                self.state = watchdog.record_restart(self.state, restart.pod, restart.rss_bytes, now, spec)
                restarts.append((restart, self._now_rfc3339()))
        await self._report_holds(fleet, by_name, decision, now)
        await self._write_status(fleet, decision, restarts)

    def _record_samples(self, fleet: Fleet, samples: Mapping[str, watchdog.Sample]) -> None:
        for pod in self._rss_series - set(samples):  # no series for pods that are gone or not polled
            metrics.PROXY_RSS.remove(fleet.namespace, fleet.name, pod)
        self._rss_series = {pod for pod, s in samples.items() if isinstance(s, watchdog.RssSample)}
        for pod, sample in samples.items():
            if isinstance(sample, watchdog.RssSample):
                metrics.PROXY_RSS.labels(fleet.namespace, fleet.name, pod).set(sample.rss_bytes)
            elif isinstance(sample, watchdog.PollFailure):
                metrics.POLL_FAILURES.labels(fleet.namespace, fleet.name, reason_label(sample.reason)).inc()

    async def _restart(self, fleet: Fleet, pod: dict[str, Any], restart: watchdog.Restart) -> bool:
        """Graceful deletion with the pod's own grace period; the uid precondition makes sure a
        replacement that took the name in between is never the one deleted."""
        meta = pod["metadata"]
        path = resource_path("v1", "Pod", fleet.namespace, meta["name"])
        body = {"preconditions": {"uid": meta["uid"]}}
        try:
            deleted = await self._call(self.api.delete, path, body)
        except Exception as exc:  # a refused delete is reported and retried next cycle
            log.warning("fleet %s/%s: deleting %s failed: %s", fleet.namespace, fleet.name, meta["name"], exc)
            return False
        if not deleted:
            return False
        message = watchdog.restart_message(restart, fleet.proxy.memory)
        log.info("fleet %s/%s: %s", fleet.namespace, fleet.name, message)
        await self.post_event(_fleet_ref(fleet), "Warning", "MemoryRestart", message)
        await self.post_event(_as_pod(pod), "Warning", "MemoryRestart", message)
        metrics.MEMORY_RESTARTS.labels(fleet.namespace, fleet.name, "OverBudget").inc()
        metrics.PROXIES_DELETED.labels(fleet.namespace, fleet.name, "MemoryBudget").inc()
        return True

    async def _report_holds(
        self, fleet: Fleet, pods: Mapping[str, dict[str, Any]], decision: watchdog.Decision, now: float
    ) -> None:
        """An Event when a proxy's hold reason changes (not every cycle of a long backoff)."""
        current = {hold.pod: hold for hold in decision.held}
        for pod, hold in current.items():
            if self._holds.get(pod) != hold.reason:
                message = watchdog.hold_message(hold, fleet.proxy.memory, now)
                reason = (
                    "MemoryRestartDryRun"
                    if hold.reason == watchdog.DRY_RUN
                    else f"MemoryRestart{hold.reason}"
                )
                kind = "Normal" if hold.reason == watchdog.DRY_RUN else "Warning"
                await self.post_event(_fleet_ref(fleet), kind, reason, message)
                if pod in pods:
                    await self.post_event(_as_pod(pods[pod]), kind, reason, message)
                if hold.reason == watchdog.DRY_RUN:
                    metrics.MEMORY_RESTARTS.labels(fleet.namespace, fleet.name, "DryRun").inc()
        self._holds = {pod: hold.reason for pod, hold in current.items()}

    async def _write_status(
        self,
        fleet: Fleet,
        decision: watchdog.Decision,
        restarts: list[tuple[watchdog.Restart, str]],
    ) -> None:
        def owned_for(stored: Mapping[str, Any]) -> dict[str, Any]:
            previous = stored.get("conditions") or []
            now = self._now_rfc3339()
            storage = watchdog.storage_condition(self._storage, fleet.generation, enabled=decision.enabled)
            owned: dict[str, Any] = {
                "conditions": [
                    condition_entry(watchdog.memory_condition(decision, fleet.generation), previous, now),
                    condition_entry(storage, previous, now),
                ]
            }
            memory_restarts = stored.get("memoryRestarts")
            for restart, stamp in restarts:
                memory_restarts = watchdog.memory_restarts_status(memory_restarts, restart, stamp)
            if memory_restarts is not None:  # applied every time: a field left out is given up
                owned["memoryRestarts"] = memory_restarts
            return owned

        async with self.status_lock:
            await apply_status(
                self._call_api, self.fleets, fleet.namespace, fleet.name, WATCHDOG_MANAGER, owned_for
            )


def _as_pod(pod: dict[str, Any]) -> dict[str, Any]:
    """List items come without apiVersion and kind; an Event's involvedObject needs them."""
    return {"apiVersion": "v1", "kind": "Pod", **pod}


def _fleet_ref(fleet: Fleet) -> dict[str, Any]:
    return {
        "apiVersion": "rolloutfleet.dev/v1alpha1",
        "kind": "RolloutFleet",
        "metadata": {"name": fleet.name, "namespace": fleet.namespace, "uid": fleet.uid},
    }


def reason_label(reason: str) -> str:
    """A metric label with few values from a poll failure's reason (stats_poll.py words them)."""
    if reason.startswith("no answer"):
        return "timeout"
    if reason.startswith("HTTP "):
        return "http_" + reason.split()[1]
    if reason.startswith("answer"):
        return "bad_answer"
    return "connection"
