"""Per-fleet background work without a finalizer: the periodic reconcile pass and the memory watchdog.

kopf's timers and daemons put a finalizer on every object they serve, so a fleet could not be
deleted while the operator is down (and uninstalling the operator first would strand every fleet).
The fleet's children need no clean-up, their ownerReferences garbage-collect them, so this work
runs in one plain task per fleet instead: started and fed with the latest object by the fleet's
watch events (the initial listing included, so an operator restart picks every fleet up again),
stopped by its DELETED event.

The same task runs the passes that pod events ask for (`wake`): coalesced, so a burst of events
makes one pass, and never two passes of one fleet at once. Failed rounds back off exponentially
with jitter (pacing.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from .fleet import Fleet, parse_fleet
from .pacing import PassSchedule, backoff_s
from .watch_cache import FleetStore, Key

log = logging.getLogger("rolloutfleet.operator")


class Watchdog(Protocol):
    async def cycle(self, fleet: Fleet) -> Any: ...


def jittered_backoff(failures: int) -> float:
    return backoff_s(failures, random.random())


@dataclass
class _Timer:
    """One fleet's pass schedule, and the event that wakes its task when a pass is asked for."""

    schedule: PassSchedule
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)


class FleetLoops:
    def __init__(
        self,
        run_pass: Callable[[dict[str, Any]], Awaitable[bool]],
        make_watchdog: Callable[[Key], Awaitable[tuple[Watchdog, Callable[[], Awaitable[None]]]]],
        resync_s: float,
        fleets: FleetStore | None = None,
        clock: Callable[[], float] = time.monotonic,
        backoff: Callable[[int], float] = jittered_backoff,
    ):
        self._run_pass = run_pass  # -> whether the pass did all it meant to (False: back off)
        self._make_watchdog = make_watchdog  # -> (watchdog, its close())
        self._resync_s = resync_s
        self.store = fleets if fleets is not None else FleetStore()
        self._clock = clock
        self._backoff = backoff
        self._tasks: dict[Key, asyncio.Task] = {}
        self._timers: dict[Key, _Timer] = {}

    def observe(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        """A watch event of a fleet (type None: the initial listing)."""
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        if event_type == "DELETED" or meta.get("deletionTimestamp"):
            self.store.forget(*key)
            self._timers.pop(key, None)
            task = self._tasks.pop(key, None)
            if task is not None:
                task.cancel()
            return
        self.store.put(body)
        task = self._tasks.get(key)
        if task is None or task.done():
            # create/update/resume just ran a pass: the loop's first is a resync later
            self._timers[key] = _Timer(PassSchedule(self._clock() + self._resync_s))
            self._tasks[key] = asyncio.create_task(self._loop(key), name=f"fleet-{key[0]}-{key[1]}")

    def wake(self, namespace: str, name: str) -> bool:
        """Ask for a pass of this fleet soon (coalesced with other requests); False when the fleet
        has no loop (unknown or being deleted)."""
        timer = self._timers.get((namespace, name))
        if timer is None:
            return False
        timer.schedule = timer.schedule.requested(self._clock())
        timer.wakeup.set()
        return True

    @property
    def fleets(self) -> list[Key]:
        return sorted(self._tasks)

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        self._timers.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _loop(self, key: Key) -> None:
        watchdog, close = await self._make_watchdog(key)
        pass_failures = check_failures = 0
        try:
            next_check = self._clock()
            while (timer := self._timers.get(key)) is not None and (body := self.store.get(*key)):
                now = self._clock()
                interval = self._resync_s
                try:
                    fleet = parse_fleet(body)
                except Exception:  # the CRD's schema should make this impossible; logged, retried
                    log.exception("fleet %s/%s: cannot parse", *key)
                    pass_failures += 1
                    await asyncio.sleep(self._backoff(pass_failures))
                    continue
                interval = float(fleet.proxy.memory.check_interval_s)
                if now >= timer.schedule.due:
                    # Requests arriving during the pass move it from "never" to soon again.
                    timer.schedule = PassSchedule(math.inf)
                    succeeded = await self._guarded(self._run_pass(body), key, "pass")
                    pass_failures = 0 if succeeded else pass_failures + 1
                    timer.schedule = timer.schedule.after_pass(
                        self._clock(), self._resync_s, None if succeeded else self._backoff(pass_failures)
                    )
                if now >= next_check:
                    checked = await self._guarded(watchdog.cycle(fleet), key, "memory check") is not False
                    check_failures = 0 if checked else check_failures + 1
                    wait = interval if checked else self._backoff(check_failures)
                    next_check = self._clock() + wait
                timer.wakeup.clear()
                delay = max(0.0, min(timer.schedule.due, next_check) - self._clock())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(timer.wakeup.wait(), delay)
        finally:
            await close()

    async def _guarded(self, work: Awaitable[Any], key: Key, what: str) -> Any:
        """The work's result, or False when it raised (logged; the loop goes on)."""
        try:
            return await work
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("fleet %s/%s: background %s failed", key[0], key[1], what)
            return False
