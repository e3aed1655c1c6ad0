"""The operator's pacing rules (pacing.py): exponential backoff with jitter, coalescing of passes
asked for by events, and the token bucket of the client-side rate limit."""

from __future__ import annotations

import math
import threading

import pytest
from rolloutfleet_operator.pacing import BACKOFF_CAP_S, PassSchedule, TokenBucket, backoff_s


@pytest.mark.parametrize(
    ("failures", "low", "high"),
    [
        (1, 2.5, 5.0),
        (2, 5.0, 10.0),
        (3, 10.0, 20.0),
        (7, 150.0, 300.0),
        (40, 150.0, 300.0),
        (10_000, 150.0, 300.0),
    ],
)
def test_backoff_doubles_up_to_the_cap_with_equal_jitter(failures, low, high):
    assert backoff_s(failures, 0.0) == low  # never below half the step
    assert backoff_s(failures, 0.999999) == pytest.approx(high, rel=1e-5)
    assert high <= BACKOFF_CAP_S


def test_backoff_jitter_spreads_fleets_failing_together():
    waits = {round(backoff_s(3, rand), 3) for rand in (0.1, 0.4, 0.7)}
    assert len(waits) == 3


def test_backoff_counts_zero_failures_as_one():
    assert backoff_s(0, 0.5) == backoff_s(1, 0.5)


def test_a_burst_of_requests_moves_the_pass_once():
    schedule = PassSchedule(due=10.0)  # the periodic resync
    first = schedule.requested(now=1.0, coalesce_s=0.2)
    assert first.due == pytest.approx(1.2)
    later = first.requested(now=1.1, coalesce_s=0.2)  # a second event within the window
    assert later.due == pytest.approx(1.2)  # not pushed back: the first event waits at most 0.2 s


def test_a_request_never_delays_a_pass_already_due_sooner():
    assert PassSchedule(due=1.0).requested(now=0.95, coalesce_s=0.2).due == 1.0


def test_after_a_pass_the_next_is_a_resync_later_or_backs_off():
    running = PassSchedule(due=math.inf)  # while a pass runs nothing else is due
    assert running.after_pass(now=5.0, resync_s=10.0).due == 15.0
    assert running.after_pass(now=5.0, resync_s=10.0, backoff_s=40.0).due == 45.0
    assert running.after_pass(now=5.0, resync_s=10.0, backoff_s=2.0).due == 15.0  # never sooner


def test_a_request_during_a_pass_stays_due():
    during = PassSchedule(due=math.inf).requested(now=5.1, coalesce_s=0.2)
    assert during.after_pass(now=6.0, resync_s=10.0, backoff_s=40.0).due == pytest.approx(5.3)


class FakeTime:
    def __init__(self):
        self.now = 0.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_token_bucket_allows_a_burst_then_the_rate():
    time = FakeTime()
    bucket = TokenBucket(qps=10, burst=3, clock=time.clock, sleep=time.sleep)
    for _ in range(3):
        bucket.acquire()
    assert time.slept == []  # the burst
    bucket.acquire()
    bucket.acquire()
    assert time.slept == [pytest.approx(0.1), pytest.approx(0.1)]  # then 10 per second
    time.now += 10  # idle: the bucket refills, up to the burst only
    for _ in range(3):
        bucket.acquire()
    assert len(time.slept) == 2
    bucket.acquire()
    assert len(time.slept) == 3


def test_token_bucket_reservations_queue_callers_in_order():
    time = FakeTime()
    bucket = TokenBucket(qps=2, burst=1, clock=time.clock, sleep=time.sleep)
    assert [bucket.reserve() for _ in range(4)] == [0.0, 0.5, 1.0, 1.5]


def test_token_bucket_is_shared_by_threads():
    bucket = TokenBucket(qps=1000, burst=1000)
    waits: list[float] = []

    def take() -> None:
        waits.extend(bucket.reserve() for _ in range(250))

    threads = [threading.Thread(target=take) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(waits) == 1000 and max(waits) < 0.05  # no token handed out twice, none lost


def test_token_bucket_refuses_a_rate_of_zero():
    with pytest.raises(ValueError):
        TokenBucket(qps=0, burst=1)
