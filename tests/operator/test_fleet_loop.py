"""The per-fleet background loop (fleet_loop.py): started by watch events, runs the periodic pass
and the watchdog on their intervals, survives a failing round, stops on DELETED. The pass and the
watchdog here are recording stand-ins (plain callables); the loop's own scheduling is what runs."""

from __future__ import annotations

import asyncio

from rolloutfleet_operator.fleet_loop import FleetLoops


def fleet_body(check_interval_s: int = 1) -> dict:
    return {
        "metadata": {"name": "f", "namespace": "ns", "uid": "u", "generation": 1},
        "spec": {
            "proxy": {"tokenizer": {"path": "/t"}, "memory": {"checkIntervalSeconds": check_interval_s}},
            "externalEngineUrls": ["http://e:1"],
        },
    }


class Recorder:
    def __init__(self, fail_first: bool = False):
        self.passes: list[dict] = []
        self.cycles: list[str] = []
        self.closed = 0
        self.fail_first = fail_first
        self.pass_fails = False

    async def run_pass(self, body: dict) -> bool:
        self.passes.append(body)
        return not self.pass_fails

    async def make_watchdog(self, key):
        recorder = self

        class StandInWatchdog:
            async def cycle(self, fleet) -> None:
                recorder.cycles.append(fleet.name)
                if recorder.fail_first and len(recorder.cycles) == 1:
                    raise RuntimeError("first cycle fails")

        async def close() -> None:
            self.closed += 1

        return StandInWatchdog(), close


async def test_events_start_feed_and_stop_one_loop_per_fleet():
    recorder = Recorder()
    loops = FleetLoops(recorder.run_pass, recorder.make_watchdog, resync_s=0.05)
    loops.observe(None, fleet_body())
    loops.observe("MODIFIED", fleet_body())  # the same fleet: still one loop
    assert loops.fleets == [("ns", "f")]
    await asyncio.sleep(1.3)
    assert len(recorder.cycles) == 2  # at 0 s and 1 s: the fleet's checkIntervalSeconds
    assert 10 <= len(recorder.passes) <= 30  # every 0.05 s, after the first interval
    loops.observe("DELETED", fleet_body())
    await asyncio.sleep(0.1)
    assert loops.fleets == [] and recorder.closed == 1
    passes = len(recorder.passes)
    await asyncio.sleep(0.2)
    assert len(recorder.passes) == passes  # stopped


async def test_a_failing_round_is_retried_not_fatal():
    recorder = Recorder(fail_first=True)
    loops = FleetLoops(recorder.run_pass, recorder.make_watchdog, resync_s=100, backoff=lambda n: 0.2)
    loops.observe(None, fleet_body(check_interval_s=60))
    await asyncio.sleep(0.5)
    assert recorder.cycles == ["f", "f"]  # retried after the error delay, not after 60 s
    await loops.stop()
    assert recorder.closed == 1


async def test_a_fleet_being_deleted_gets_no_loop():
    recorder = Recorder()
    loops = FleetLoops(recorder.run_pass, recorder.make_watchdog, resync_s=0.05)
    body = fleet_body()
    body["metadata"]["deletionTimestamp"] = "2026-11-21T00:00:00Z"
    loops.observe("MODIFIED", body)
    assert loops.fleets == []


async def test_a_burst_of_wakes_runs_one_pass_soon():
    recorder = Recorder()
    loops = FleetLoops(recorder.run_pass, recorder.make_watchdog, resync_s=100)
    loops.observe(None, fleet_body(check_interval_s=60))
    await asyncio.sleep(0.05)
    for _ in range(5):  # e.g. a pod's DELETED event and its replacement's first events
        assert loops.wake("ns", "f")
    await asyncio.sleep(0.5)
    assert len(recorder.passes) == 1  # coalesced, and run long before the 100 s resync
    loops.wake("ns", "f")
    await asyncio.sleep(0.5)
    assert len(recorder.passes) == 2
    assert not loops.wake("ns", "unknown")
    await loops.stop()


async def test_failing_passes_back_off():
    recorder = Recorder()
    recorder.pass_fails = True  # e.g. a child the API server refuses
    waits: list[int] = []

    def backoff(failures: int) -> float:
        waits.append(failures)
        return 0.1 * 2**failures

    loops = FleetLoops(recorder.run_pass, recorder.make_watchdog, resync_s=0.05, backoff=backoff)
    loops.observe(None, fleet_body(check_interval_s=60))
    await asyncio.sleep(1.6)  # passes at ~0.05, +0.2, +0.4, +0.8: the waits double
    assert waits[:3] == [1, 2, 3] and 3 <= len(recorder.passes) <= 5
    recorder.pass_fails = False
    await asyncio.sleep(1.7)  # at most 1.6 s left of the backoff, then every 0.05 s again
    passes = len(recorder.passes)
    await asyncio.sleep(0.3)
    assert len(recorder.passes) >= passes + 3
    await loops.stop()
