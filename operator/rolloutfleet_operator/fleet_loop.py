"""Per-fleet background work without a finalizer: the periodic reconcile pass and the memory watchdog.

kopf's timers and daemons put a finalizer on every object they serve, so a fleet could not be
deleted while the operator is down (and uninstalling the operator first would strand every fleet).
The fleet's children need no clean-up, their ownerReferences garbage-collect them, so this work
runs in one plain task per fleet instead: started and fed with the latest object by the fleet's
watch events (the initial listing included, so an operator restart picks every fleet up again),
stopped by its DELETED event.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from .fleet import Fleet, parse_fleet

log = logging.getLogger("rolloutfleet.operator")

Key = tuple[str, str]  # (namespace, name)
ERROR_DELAY_S = 5.0


class Watchdog(Protocol):
    async def cycle(self, fleet: Fleet) -> Any: ...


class FleetLoops:
    def __init__(
        self,
        run_pass: Callable[[dict[str, Any]], Awaitable[None]],
        make_watchdog: Callable[[Key], Awaitable[tuple[Watchdog, Callable[[], Awaitable[None]]]]],
        resync_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._run_pass = run_pass
        self._make_watchdog = make_watchdog  # -> (watchdog, its close())
        self._resync_s = resync_s
        self._clock = clock
        self._latest: dict[Key, dict[str, Any]] = {}
        self._tasks: dict[Key, asyncio.Task] = {}

    def observe(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        """A watch event of a fleet (type None: the initial listing)."""
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        if event_type == "DELETED" or meta.get("deletionTimestamp"):
            self._latest.pop(key, None)
            task = self._tasks.pop(key, None)
            if task is not None:
                task.cancel()
            return
        self._latest[key] = dict(body)
        task = self._tasks.get(key)
        if task is None or task.done():
            self._tasks[key] = asyncio.create_task(self._loop(key), name=f"fleet-{key[0]}-{key[1]}")

    @property
    def fleets(self) -> list[Key]:
        return sorted(self._tasks)

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        self._latest.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _loop(self, key: Key) -> None:
        watchdog, close = await self._make_watchdog(key)
        try:
            next_pass = self._clock() + self._resync_s  # create/update/resume just ran a pass
            next_check = self._clock()
            while key in self._latest:
                body = self._latest[key]
                now = self._clock()
                interval = self._resync_s
                try:
                    fleet = parse_fleet(body)
                    interval = float(fleet.proxy.memory.check_interval_s)
                    if now >= next_pass:
                        next_pass = now + self._resync_s
                        await self._run_pass(body)
                    if now >= next_check:
                        next_check = now + interval
                        await watchdog.cycle(fleet)
                except asyncio.CancelledError:
                    raise
                except Exception:  # logged; the next round runs anyway
                    log.exception("fleet %s/%s: background pass failed", *key)
                    next_pass = next_check = self._clock() + ERROR_DELAY_S  # both, soon
                await asyncio.sleep(max(0.0, min(next_pass, next_check) - self._clock()))
        finally:
            await close()
