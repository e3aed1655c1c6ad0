"""One fleet's memory watchdog cycle (memory_watchdog.py): the polls go to real /stats stand-ins on
loopback addresses (one per pod IP, all on the fleet's port, as pods listen), the API is the
recording stand-in. A restart is decided under the fleet's lock on the newest spec, decided again
from the pods as the API server lists them, and carried out as an eviction with the pod's uid; a
refusal by the PodDisruptionBudget is a hold with its reason in the condition, never a delete."""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import Iterator

import aiohttp
import pytest
from fleet_samples import sample
from recording_api import READY, RecordingApi, cluster_at_rest
from rolloutfleet_operator.fleet import parse_fleet
from rolloutfleet_operator.memory_watchdog import FleetWatchdog
from rolloutfleet_operator.watch_cache import FleetStore, OwnedObjects
from rolloutfleet_testkit.processes import free_port, serve_app
from rolloutfleet_testkit.stats_standin import StatsStandin

MIB = 1 << 20
BUDGET = 100 * MIB
REPLICAS = 3


def fleet_body(port: int, **memory) -> dict:
    body = sample("minimal")
    body["spec"]["proxy"].update({"replicas": REPLICAS, "port": port})
    body["spec"]["proxy"]["memory"] = {
        "rssBudgetBytes": BUDGET,
        "checkIntervalSeconds": 1,
        "consecutiveSamples": 1,
        "maxUnavailable": 1,
        **memory,
    }
    return body


def address(ordinal: int) -> str:
    return f"127.0.0.{ordinal + 2}"


@contextlib.contextmanager
def standins(port: int) -> Iterator[list[StatsStandin]]:
    """A /stats stand-in at each proxy's address, all on `port`, reporting 50 MiB."""
    apps = [StatsStandin(rss_bytes=50 * MIB) for _ in range(REPLICAS)]
    with contextlib.ExitStack() as stack:
        for ordinal, app in enumerate(apps):
            stack.enter_context(serve_app(app, host=address(ordinal), port=port))
        yield apps


class Setup:
    def __init__(self, body: dict):
        self.body = body
        self.indexes = cluster_at_rest(body)
        self.pods = self.indexes[("v1", "Pod")][("rl", body["metadata"]["name"])]
        for ordinal, pod in enumerate(self.pods):
            pod["metadata"] = {**pod["metadata"], "uid": f"pod-{ordinal}"}
            pod["status"] = {**READY, "podIP": address(ordinal)}
        self.api = RecordingApi(body)
        self.api.pods = copy.deepcopy(self.pods)  # the API server agrees with the cache
        self.fleets = FleetStore()
        self.fleets.put(self.api.fleet)
        self.events: list[tuple[str, str, str]] = []  # (involved kind, type, reason)
        self.lock = asyncio.Lock()

    def watchdog(self, http: aiohttp.ClientSession) -> FleetWatchdog:
        async def post_event(obj, type: str, reason: str, message: str) -> None:
            self.events.append((obj["kind"], type, reason))

        owned = OwnedObjects(self.indexes)
        return FleetWatchdog(self.api, self.fleets, owned, http, post_event, self.lock)  # type: ignore[arg-type]

    def pressure(self) -> dict:
        return next(c for c in self.api.fleet["status"]["conditions"] if c["type"] == "MemoryPressure")


@pytest.fixture
def port() -> int:
    return free_port()


async def test_an_over_budget_proxy_is_evicted_with_its_uid_once_a_fresh_list_agrees(port):
    setup = Setup(fleet_body(port))
    name = f"{setup.body['metadata']['name']}-proxy-1"
    with standins(port) as apps:
        apps[1].rss_bytes = 150 * MIB
        async with aiohttp.ClientSession() as http:
            await setup.watchdog(http).cycle(parse_fleet(setup.body))
    calls = [c for c in setup.api.calls if c[0] in ("list", "evict", "delete")]
    assert calls == [("list", "Pod"), ("evict", name, "pod-1")]
    assert ("RolloutFleet", "Warning", "MemoryRestart") in setup.events
    assert ("Pod", "Warning", "MemoryRestart") in setup.events
    assert setup.api.fleet["status"]["memoryRestarts"]["lastPod"] == name


async def test_a_refused_eviction_is_a_hold_with_its_reason_never_a_delete(port):
    setup = Setup(fleet_body(port))
    setup.api.eviction_outcome = "refused"  # a drain took the PodDisruptionBudget's room
    name = f"{setup.body['metadata']['name']}-proxy-0"
    with standins(port) as apps:
        apps[0].rss_bytes = 150 * MIB
        async with aiohttp.ClientSession() as http:
            watchdog = setup.watchdog(http)
            for _ in range(2):
                await watchdog.cycle(parse_fleet(setup.body))
    assert [c for c in setup.api.calls if c[0] == "evict"] == [("evict", name, "pod-0")] * 2  # tried again
    assert not [c for c in setup.api.calls if c[0] == "delete"]
    assert "memoryRestarts" not in setup.api.fleet["status"]
    pressure = setup.pressure()
    assert (pressure["status"], pressure["reason"]) == ("True", "OverBudget")
    assert f"eviction refused by the PodDisruptionBudget: {name}" in pressure["message"]
    held = [e for e in setup.events if e[2] == "MemoryRestartDisruptionBudget"]
    assert held == [
        ("RolloutFleet", "Warning", "MemoryRestartDisruptionBudget"),
        ("Pod", "Warning", "MemoryRestartDisruptionBudget"),
    ]


async def test_a_proxy_down_in_the_fresh_list_holds_the_restart_though_the_cache_shows_it_ready(port):
    setup = Setup(fleet_body(port))
    # Evicted by a roll step or a drain a moment ago: the API server knows, the cache not yet.
    setup.api.pods[2]["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    with standins(port) as apps:
        apps[0].rss_bytes = 150 * MIB
        async with aiohttp.ClientSession() as http:
            await setup.watchdog(http).cycle(parse_fleet(setup.body))
    assert ("list", "Pod") in setup.api.calls
    assert not [c for c in setup.api.calls if c[0] in ("evict", "delete")]
    assert "waiting for maxUnavailable" in setup.pressure()["message"]


async def test_the_decision_waits_for_the_fleets_lock_and_takes_the_newest_spec(port):
    setup = Setup(fleet_body(port))
    with standins(port) as apps:
        apps[0].rss_bytes = 150 * MIB
        async with aiohttp.ClientSession() as http:
            watchdog = setup.watchdog(http)
            async with setup.lock:  # a pass holds the lock; meanwhile the spec turns on dry run
                cycle = asyncio.create_task(watchdog.cycle(parse_fleet(setup.body)))
                await asyncio.sleep(0.5)  # the polls are done; the decision waits
                assert not cycle.done() and apps[0].stats_answers >= 1
                newer = copy.deepcopy(setup.api.fleet)
                newer["metadata"]["generation"] += 1
                newer["spec"]["proxy"]["memory"]["dryRun"] = True
                setup.fleets.put(newer)
                setup.api.fleet["metadata"]["generation"] += 1
                setup.api.fleet["spec"] = newer["spec"]
            await cycle
    assert not [c for c in setup.api.calls if c[0] in ("evict", "delete")]
    assert "dry run, would restart" in setup.pressure()["message"]
