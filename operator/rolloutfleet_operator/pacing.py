"""When the operator acts, as pure rules: coalescing of event-triggered passes, exponential backoff
with jitter after failures, and the client-side rate limit on API requests.

- Coalescing: a pass asked for by an event runs `COALESCE_S` after the first such event, once for
  all of them. A roll or a node loss sends several pod events per fleet within milliseconds; one
  pass sees them all.
- Backoff: after n failed rounds in a row the next waits `backoff_s(n)`, base * 2^(n-1) capped,
  and between half and all of that at random. A broken fleet (a refused child, API errors) is
  retried ever more rarely, and fleets failing together (the API server was away) spread out.
- Refused creates: a proxy pod the API server refused to create (a quota, an admission webhook) is
  tried again only after `backoff_s(n)` of its own, however many passes pod events run meanwhile;
  until then the pass reports the last refusal without asking again (`Refused`).
- Rate limit: every request takes a token from a bucket refilled at `qps` that holds at most
  `burst`. A burst of work (the operator starting beside 50 fleets, a roll of each) cannot
  flood the API server.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

COALESCE_S = 0.2
BACKOFF_BASE_S = 5.0
BACKOFF_CAP_S = 300.0


def backoff_s(
    failures: int, rand: float, base_s: float = BACKOFF_BASE_S, cap_s: float = BACKOFF_CAP_S
) -> float:
    """The wait after `failures` failed rounds in a row (at least 1), given `rand` in [0, 1):
    "equal jitter", so it is never shorter than half the exponential step."""
    step = min(cap_s, base_s * 2 ** min(max(failures, 1) - 1, 32))
    return step / 2 + step / 2 * rand


@dataclass(frozen=True)
class PassSchedule:
    """When a fleet's next pass is due: the periodic resync, or earlier when an event asked for one."""

    due: float  # monotonic seconds

    def requested(self, now: float, coalesce_s: float = COALESCE_S) -> PassSchedule:
        """An event asks for a pass: due within `coalesce_s`, never later than already due, so a
        burst of events moves it only once."""
        return PassSchedule(min(self.due, now + coalesce_s))

    def after_pass(self, now: float, resync_s: float, backoff_s: float | None = None) -> PassSchedule:
        """After a pass: the next one a resync later, or after `backoff_s` when the pass failed
        (never sooner than a resync); a pass asked for while this one ran stays due."""
        wait = resync_s if backoff_s is None else max(resync_s, backoff_s)
        return PassSchedule(min(self.due, now + wait))


@dataclass(frozen=True)
class Refused:
    """The last refusal of one request that is retried with backoff."""

    failures: int  # in a row
    not_before: float  # monotonic seconds: no retry earlier
    message: str  # the API server's words, reported meanwhile

    def waiting(self, now: float) -> bool:
        return now < self.not_before


def refused_again(previous: Refused | None, now: float, rand: float, message: str) -> Refused:
    """The state after another refusal (`rand` in [0, 1) for the jitter)."""
    failures = (previous.failures if previous is not None else 0) + 1
    return Refused(failures, now + backoff_s(failures, rand), message)


class TokenBucket:
    """Blocking rate limit for the worker threads that make the API calls (never the event loop)."""

    def __init__(
        self,
        qps: float,
        burst: int,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ):
        if qps <= 0 or burst < 1:
            raise ValueError("qps must be above 0 and burst at least 1")
        self.qps = qps
        self.burst = burst
        self._clock = clock
        self._sleep = sleep
        self._tokens = float(burst)
        self._stamp = clock()
        self._lock = threading.Lock()

    def reserve(self) -> float:
        """Take a token; the seconds to wait before using it (0 when one was there). Reserving
        ahead keeps the order of callers and lets each sleep outside the lock."""
        with self._lock:
            now = self._clock()
            self._tokens = min(float(self.burst), self._tokens + (now - self._stamp) * self.qps)
            self._stamp = now
            self._tokens -= 1
            return 0.0 if self._tokens >= 0 else -self._tokens / self.qps

    def acquire(self) -> None:
        wait = self.reserve()
        if wait > 0:
            self._sleep(wait)
