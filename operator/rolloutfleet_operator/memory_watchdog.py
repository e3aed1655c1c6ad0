"""One fleet's memory watchdog: each cycle polls the proxies' /stats, decides (watchdog.py, pure) and
acts: eviction of over-budget proxies, Events, metrics and the fleet's status.

The polls run on their own; the decision and what follows run under the fleet's lock, the one the
reconciler's pass holds, on the newest cached spec: a roll step and a memory restart never decide
from the same view. A decision to restart is made again from the proxy pods read from the API
server (not the cache, which may lag a roll step or a drain by an event), and each restart is an
eviction, so the fleet's PodDisruptionBudget has the last word: a refusal (429) is a hold with its
reason in the MemoryPressure condition, never a DELETE past the budget.

API requests per cycle, whatever the fleet's size: none at rest (the pods and the fleet come from
the watch caches, watch_cache.py), one status apply (field manager `rolloutfleet-memory-watchdog`,
status_apply.py) when its conditions or memoryRestarts changed, plus, when a restart is decided,
one list of the proxy pods and one eviction per restart. Polls go straight to pod IPs, bounded in
concurrency and time (stats_poll.py).

Storage is reported for every running proxy, Ready or not: a proxy whose dump volume refuses
writes fails /readyz on purpose, and still answers /stats. The last report of each pod is kept
until the pod is replaced, so a poll that fails meanwhile does not erase it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

from . import metrics, watchdog
from .conditions import condition_entry
from .fleet import Fleet, parse_fleet
from .kubeapi import KubeApi
from .ownership import claim_proxy_pods, proxy_views
from .plan import ProxyPodView
from .reconcile import POD, fresh_proxy_pods
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


@dataclass(frozen=True)
class Polls:
    """One cycle's polls: RSS samples of the Ready proxies, storage reports of every running one,
    and the uids of the pods polled (a storage report is kept until its pod is replaced)."""

    samples: dict[str, watchdog.Sample] = field(default_factory=dict)
    storage: dict[str, watchdog.Sample] = field(default_factory=dict)
    uids: dict[str, str] = field(default_factory=dict)


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
        lock: asyncio.Lock,
        clock: Callable[[], float] = time.monotonic,
        now_rfc3339: Callable[[], str] | None = None,
    ):
        self.api = api
        self.fleets = fleets
        self.owned = owned
        self.http = http
        self.post_event = post_event
        self.lock = lock  # the fleet's, shared with the reconciler: one decision or status write at a time
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

    async def _cycle(self, polled: Fleet) -> None:
        """`polled`: the fleet as the loop last parsed it, which says what to poll; the decision
        takes the newest spec once it holds the lock."""
        polls = Polls()
        if polled.proxy.memory.enabled:  # off: no polls, only the conditions saying so
            polls = await self._poll(polled)
        async with self.lock:
            body = self.fleets.to_act_on(polled.namespace, polled.name)
            if body is None:  # gone, or an older spec than one already acted on
                return
            await self._decide_and_act(parse_fleet(body), polls)

    def _owned_pods(self, fleet: Fleet) -> list[dict[str, Any]]:
        """The fleet's own proxy pods from the watch cache (ownership.py: never another's)."""
        pods = self.owned.of_fleet(POD, fleet.namespace, fleet.name, "proxy")
        return [dict(pod) for pod in claim_proxy_pods(fleet, pods).owned]

    async def _poll(self, fleet: Fleet) -> Polls:
        pods = self._owned_pods(fleet)
        views = proxy_views(fleet, pods)
        targets = poll_targets(pods, views, fleet.proxy.port)
        metrics.WATCHDOG_POLLS.labels(fleet.namespace, fleet.name).inc(len(targets))
        not_ready = poll_targets(pods, views, fleet.proxy.port, ready=False)
        polled = await poll_stats(
            targets + not_ready,
            timeout_s=poll_timeout(fleet.proxy.memory.check_interval_s),
            concurrency=POLL_CONCURRENCY,
            session=self.http,
        )
        return Polls(
            samples={name: polled[name] for name, _ in targets if name in polled},
            storage=polled,
            uids={pod["metadata"]["name"]: pod["metadata"].get("uid", "") for pod in pods},
        )

    async def _decide_and_act(self, fleet: Fleet, polls: Polls) -> None:
        spec = fleet.proxy.memory
        metrics.PROXY_RSS_BUDGET.labels(fleet.namespace, fleet.name).set(spec.rss_budget_bytes)
        samples = polls.samples
        self._storage = watchdog.storage_reports(self._storage, polls.storage, polls.uids)
        self._record_samples(fleet, samples)
        pods = self._owned_pods(fleet) if spec.enabled else []
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
        views = proxy_views(fleet, pods)
        decision = watchdog.decide(self.state, list(views.values()), now, spec, desired=fleet.proxy.replicas)
        if decision.restart:
            # Decided again from the pods as they are now: the cache may lag a roll step or a drain.
            claim = await fresh_proxy_pods(self._call, self.api, fleet)
            pods = [dict(pod) for pod in claim.owned]
            views = proxy_views(fleet, pods)
            decision = watchdog.decide(
                self.state, list(views.values()), now, spec, desired=fleet.proxy.replicas
            )
        by_name = {pod["metadata"]["name"]: pod for pod in pods}
        restarts = []
        for restart in decision.restart:
            outcome = await self._restart(fleet, by_name[restart.pod], restart)
            if outcome == "evicted":
                self.state = watchdog.record_restart(self.state, restart.pod, restart.rss_bytes, now, spec)
                restarts.append((restart, self._now_rfc3339()))
            elif outcome == "refused":
                decision = watchdog.refused(decision, restart.pod)
        metrics.PROXIES_IN_BACKOFF.labels(fleet.namespace, fleet.name).set(len(decision.in_backoff))
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

    async def _restart(self, fleet: Fleet, pod: dict[str, Any], restart: watchdog.Restart) -> str:
        """Evict the proxy (graceful, with its own grace period, if its PodDisruptionBudget allows);
        the uid precondition makes sure a replacement that took the name in between is never the
        one evicted. The outcome: "evicted", "refused" (429), "gone", or "failed" (logged)."""
        meta = pod["metadata"]
        try:
            outcome: str = await self._call(self.api.evict, fleet.namespace, meta["name"], meta["uid"])
        except Exception as exc:  # reported and decided again next cycle
            log.warning("fleet %s/%s: evicting %s failed: %s", fleet.namespace, fleet.name, meta["name"], exc)
            return "failed"
        if outcome != "evicted":
            return outcome
        message = watchdog.restart_message(restart, fleet.proxy.memory)
        log.info("fleet %s/%s: %s", fleet.namespace, fleet.name, message)
        await self.post_event(_fleet_ref(fleet), "Warning", "MemoryRestart", message)
        await self.post_event(_as_pod(pod), "Warning", "MemoryRestart", message)
        metrics.MEMORY_RESTARTS.labels(fleet.namespace, fleet.name, "OverBudget").inc()
        metrics.PROXIES_DELETED.labels(fleet.namespace, fleet.name, "MemoryBudget").inc()
        return outcome

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
