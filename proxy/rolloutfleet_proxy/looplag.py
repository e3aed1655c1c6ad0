"""Event-loop lag: how late a short sleep wakes up. Any blocking call on the loop shows up here."""

from __future__ import annotations

import asyncio
import time
from collections import deque


class LoopLagMonitor:
    def __init__(self, interval_s: float = 0.02, window_s: int = 10):
        self.interval_s = interval_s
        self.window_s = window_s
        self.max_s = 0.0
        self._per_second: deque[tuple[int, float]] = deque(maxlen=window_s)

    def record(self, lag_s: float, now: float) -> None:
        self.max_s = max(self.max_s, lag_s)
        second = int(now)
        if self._per_second and self._per_second[-1][0] == second:
            if lag_s > self._per_second[-1][1]:
                self._per_second[-1] = (second, lag_s)
        else:
            self._per_second.append((second, lag_s))

    def recent_max(self, now: float) -> float:
        """Largest lag in the last `window_s` seconds."""
        oldest = int(now) - self.window_s
        return max((lag for second, lag in self._per_second if second > oldest), default=0.0)

    async def run(self) -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            self.record(max(0.0, time.perf_counter() - start - self.interval_s), time.monotonic())
