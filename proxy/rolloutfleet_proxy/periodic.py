"""A background job run every few seconds until stopped: the one loop behind cleanup, export expiry,
storage checks, journal compaction, the state flush and the stats heartbeat."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger("rolloutfleet.proxy")


def _always() -> bool:
    return True


def _never() -> bool:
    return False


class PeriodicTask:
    """Sleeps `interval_s` (seconds, or a function giving them: read before every sleep), then runs
    `action`. A failing run is logged and counted (and reported to `on_failure`); the next run retries.

    `due` is checked before anything else: a run that is not due takes no lock. With a `lock` the run
    holds it, and `finished` is checked under it: the drain takes the same lock, so no run starts during
    or after the drain; once `finished` is true the task ends."""

    def __init__(
        self,
        name: str,
        interval_s: float | Callable[[], float],
        action: Callable[[], Awaitable[Any]],
        *,
        lock: asyncio.Lock | None = None,
        due: Callable[[], bool] = _always,
        finished: Callable[[], bool] = _never,
        on_failure: Callable[[], None] | None = None,
    ):
        self.name = name
        self._interval_s = interval_s if callable(interval_s) else (lambda: interval_s)
        self._action = action
        self._lock = lock
        self._due = due
        self._finished = finished
        self._on_failure = on_failure
        self.failures = 0
        self._task: asyncio.Task | None = None

    async def run_once(self) -> bool:
        """One run (when due); False once the task is finished."""
        if not self._due():
            return True
        async with self._lock if self._lock is not None else contextlib.nullcontext():
            if self._finished():
                return False
            try:
                await self._action()
            except Exception:
                self.failures += 1
                if self._on_failure is not None:
                    self._on_failure()
                log.exception("%s failed; the next run retries", self.name)
        return True

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s())
            if not await self.run_once():
                return

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self.run(), name=self.name)

    async def stop(self) -> None:
        """Cancel the task and wait for it to end (a run under way is cancelled too)."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
