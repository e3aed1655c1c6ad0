"""The runtime's own parts: the periodic task every background job runs on, the life phases and the
turns in flight."""

from __future__ import annotations

import asyncio

from rolloutfleet_proxy.lifecycle import CancelCause, InFlightTurns, Lifecycle, Phase
from rolloutfleet_proxy.periodic import PeriodicTask
from rolloutfleet_proxy.session import Session


async def test_periodic_task_counts_a_failure_and_runs_on():
    runs, failures = [], []

    async def flaky() -> None:
        runs.append(1)
        if len(runs) == 1:
            raise RuntimeError("disk vanished")

    task = PeriodicTask("flaky", 0.001, flaky, on_failure=lambda: failures.append(1))
    task.start()
    for _ in range(500):
        if len(runs) >= 3:
            break
        await asyncio.sleep(0.002)
    await task.stop()
    assert len(runs) >= 3 and task.failures == 1 and failures == [1]


async def test_periodic_task_skips_runs_not_due_and_ends_once_finished_under_its_lock():
    lock, runs = asyncio.Lock(), []
    state = {"due": False, "finished": False}

    async def action() -> None:
        runs.append(1)

    task = PeriodicTask(
        "job", 0.0, action, lock=lock, due=lambda: state["due"], finished=lambda: state["finished"]
    )
    assert await task.run_once() and runs == []  # not due: nothing ran
    state["due"] = True
    assert await task.run_once() and runs == [1]
    async with lock:  # as the drain does: the run waits, then sees the drain and ends
        pending = asyncio.create_task(task.run_once())
        await asyncio.sleep(0)
        state["finished"] = True
    assert await pending is False and runs == [1]


async def test_stopping_a_periodic_task_cancels_a_run_under_way():
    started, cancelled = asyncio.Event(), []

    async def slow() -> None:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(1)
            raise

    task = PeriodicTask("slow", 0.0, slow)
    task.start()
    await asyncio.wait_for(started.wait(), 5)
    await task.stop()
    assert cancelled == [1]
    await task.stop()  # a second stop is harmless


async def test_lifecycle_a_drain_during_start_up_stays_a_drain():
    life = Lifecycle()
    assert life.phase is Phase.STARTING and not life.serving and not life.draining
    life.begin_drain()
    life.started()  # the start finished after the SIGTERM: still draining, never serving
    assert life.phase is Phase.DRAINING and life.start_finished and life.lost_sessions
    life.drain_finished(ok=True)
    assert life.draining and not life.lost_sessions
    other = Lifecycle()
    other.started()
    assert other.serving and not other.draining
    other.begin_drain()
    other.drain_finished(ok=False)
    assert other.phase is Phase.DRAIN_FAILED and other.lost_sessions


async def test_in_flight_turns_idle_when_every_turn_ended_and_cancel_reaches_the_generation():
    life = Lifecycle()
    turns = InFlightTurns(life)
    session = Session("session-1", b"k" * 32)
    generation = asyncio.create_task(asyncio.sleep(60))
    with turns.turn():
        idle = asyncio.create_task(turns.wait_idle())
        with turns.generation(session, generation) as in_flight:
            assert turns.generating == 1
            assert turns.cancel(session, CancelCause.CLIENT_GONE)
            turns.cancel(session, CancelCause.DELETED)  # the first cause is the one kept
            await asyncio.wait({generation})
            assert in_flight.cancelled_by is CancelCause.CLIENT_GONE
        await asyncio.sleep(0)
        assert not idle.done()
    await asyncio.wait_for(idle, 5)
    assert generation.cancelled() and turns.generating == 0
    assert not turns.closed
    life.begin_drain()
    assert turns.closed
