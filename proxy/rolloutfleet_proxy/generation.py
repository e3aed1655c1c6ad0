"""The model version turns are generated under, and the pause that lets the trainer swap weights.

While paused, turns wait before their upstream call (bounded by `max_wait_s`, then 503) and turns
already generating finish; `idle` is set when none is generating, which is when weights can change.
"""

from __future__ import annotations

import asyncio
import time

from .failures import PauseOutlasted, ShuttingDown

MAX_MODEL_VERSION = 2**31 - 1  # versions are stored per turn as int32


class GenerationControl:
    def __init__(self, max_wait_s: float, model_version: int = 0, paused: bool = False):
        self.max_wait_s = max_wait_s
        self.model_version = model_version
        self.paused = paused
        self.generating = 0  # turns past the gate, in their upstream call
        self.waiting = 0  # turns held at the gate by a pause
        self.idle = asyncio.Event()
        self.idle.set()
        self._closed = False
        # Set on every resume/close; waiters re-check the state in a loop, because a pause right
        # after a resume must hold a waiter that was woken but has not run yet.
        self._wakeup = asyncio.Event()
        if not paused:
            self._wakeup.set()

    def pause(self) -> None:
        self.paused = True
        self._wakeup.clear()

    def resume(self) -> None:
        self.paused = False
        self._wakeup.set()

    def close(self) -> None:
        """Shutdown: turns waiting at the gate give up at once (ShuttingDown) instead of holding the drain."""
        self._closed = True
        self._wakeup.set()

    async def enter(self) -> tuple[int, float]:
        """Wait while paused; returns the model version this generation runs under and the seconds
        waited. Raises `PauseOutlasted` after `max_wait_s`, `ShuttingDown` on shutdown."""
        waited = 0.0
        if self.paused and not self._closed:
            started = time.monotonic()
            deadline = started + self.max_wait_s
            self.waiting += 1
            try:
                while self.paused and not self._closed:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise PauseOutlasted(self.max_wait_s)
                    try:
                        await asyncio.wait_for(self._wakeup.wait(), remaining)
                    except TimeoutError:
                        continue
            finally:
                self.waiting -= 1
                waited = time.monotonic() - started
        if self._closed:
            raise ShuttingDown("the proxy is shutting down; nothing was recorded")
        self.generating += 1
        self.idle.clear()
        return self.model_version, waited

    def leave(self) -> None:
        self.generating -= 1
        if self.generating == 0:
            self.idle.set()
