"""The memory watchdog's pure decisions: streaks, maxUnavailable, cooldown and backoff, dry run."""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping, Sequence

import pytest
from rolloutfleet_operator.conditions import Condition
from rolloutfleet_operator.fleet import MemorySpec
from rolloutfleet_operator.plan import ProxyPodView
from rolloutfleet_operator.watchdog import (
    BACKOFF,
    COOLDOWN,
    DISRUPTION_BUDGET,
    DRY_RUN,
    MAX_UNAVAILABLE,
    MEMORY_PRESSURE,
    REPORTED_POLL_FAILURES,
    Decision,
    FleetMemoryState,
    Hold,
    PollFailure,
    PollTrouble,
    Restart,
    RssSample,
    Sample,
    cooldown_after,
    count_unavailable,
    decide,
    hold_message,
    memory_condition,
    memory_restarts_status,
    observe,
    quiet_period_s,
    record_restart,
    refused,
    restart_message,
    retain,
    seed_from_status,
    with_memory_condition,
)

GiB = 1 << 30
BUDGET = 4 * GiB
OVER = 5 * GiB
UNDER = 3 * GiB
FAIL = PollFailure("no answer within 2s")
INTERVAL = 15.0
SPEC = MemorySpec(
    rss_budget_bytes=BUDGET,
    check_interval_s=int(INTERVAL),
    consecutive_samples=3,
    max_unavailable=1,
    cooldown_s=300,
    max_cooldown_s=3600,
    dry_run=False,
)


def spec(**changes) -> MemorySpec:
    return dataclasses.replace(SPEC, **changes)


def name(ordinal: int) -> str:
    return f"f-proxy-{ordinal}"


def pods(
    count: int, not_ready: Sequence[int] = (), terminating: Sequence[int] = (), absent: Sequence[int] = ()
) -> list[ProxyPodView]:
    return [
        ProxyPodView(
            name=name(i),
            ordinal=i,
            ready=i not in not_ready and i not in terminating,
            phase="Running",
            deleting=i in terminating,
        )
        for i in range(count)
        if i not in absent
    ]


def sample(value: int | PollFailure) -> Sample:
    return value if isinstance(value, PollFailure) else RssSample(value)


def breaching(rss_by_ordinal: Mapping[int, int], memory: MemorySpec = SPEC, now: float = 0.0):
    """A state in which each given pod has just reported its RSS `consecutive_samples` times."""
    state = FleetMemoryState()
    for cycle in range(memory.consecutive_samples):
        samples = {name(i): RssSample(rss) for i, rss in rss_by_ordinal.items()}
        state = observe(state, samples, now - (memory.consecutive_samples - 1 - cycle) * INTERVAL, memory)
    return state


def run_one_pod(series: Sequence[int | PollFailure | None], memory: MemorySpec = SPEC) -> list[int]:
    """Feed one pod's samples cycle by cycle (None: not polled, i.e. not Ready that cycle), restarting
    it as the operator would; returns the cycles in which it was restarted."""
    state = FleetMemoryState()
    restarted = []
    for cycle, value in enumerate(series):
        now = cycle * INTERVAL
        polled = {} if value is None else {name(0): sample(value)}
        state = observe(state, polled, now, memory)
        decision = decide(state, pods(1, not_ready=[0] if value is None else []), now, memory, desired=1)
        for restart in decision.restart:
            state = record_restart(state, restart.pod, restart.rss_bytes, now, memory)
            restarted.append(cycle)
    return restarted


# --- consecutive samples -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "series", "restarts"),
    [
        ("K-1 samples over: no restart", [OVER, OVER], []),
        ("K samples over: restart on the K-th", [OVER, OVER, OVER], [2]),
        ("a dip below the budget resets the streak", [OVER, OVER, UNDER, OVER, OVER], []),
        ("a new streak after a dip restarts on its K-th", [OVER, OVER, UNDER, OVER, OVER, OVER], [5]),
        ("exactly at the budget is within it", [BUDGET, BUDGET, BUDGET, BUDGET], []),
        ("one byte over is over", [BUDGET + 1] * 3, [2]),
        ("a failed poll neither counts nor resets", [OVER, OVER, FAIL, OVER], [3]),
        ("failed polls alone never restart", [OVER, FAIL, FAIL, FAIL, FAIL, FAIL], []),
        ("a cycle without a poll (not Ready) resets", [OVER, OVER, None, OVER, OVER], []),
        ("and the streak starts again after it", [OVER, OVER, None, OVER, OVER, OVER], [5]),
    ],
)
def test_consecutive_breaches(case, series, restarts):
    assert run_one_pod(series) == restarts, case


def test_one_sample_suffices_when_k_is_1():
    assert run_one_pod([UNDER, OVER], spec(consecutive_samples=1)) == [1]


def test_observe_keeps_the_last_rss_and_restart_clears_the_streak():
    state = breaching({0: OVER})
    record = state.record(name(0))
    assert (record.consecutive_breaches, record.last_rss_bytes) == (3, OVER)
    after = record_restart(state, name(0), OVER, 0.0, SPEC).record(name(0))
    assert after.consecutive_breaches == 0 and after.restarts_in_window == 1
    assert after.cooldown_until == SPEC.cooldown_s and after.last_restart_at == 0.0


# --- maxUnavailable ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "over", "fleet", "max_unavailable", "restarted", "held"),
    [
        ("one over budget", {0: OVER}, pods(3), 1, [0], []),
        ("two over, one slot: highest RSS first", {0: OVER, 2: OVER + GiB}, pods(3), 1, [2], [0]),
        ("two over, two slots: both, highest first", {0: OVER, 2: OVER + GiB}, pods(3), 2, [2, 0], []),
        ("equal RSS: by name", {1: OVER, 0: OVER}, pods(3), 1, [0], [1]),
        ("a not-ready pod uses the slot", {0: OVER}, pods(3, not_ready=[1]), 1, [], [0]),
        ("a terminating pod uses the slot", {0: OVER}, pods(3, terminating=[2]), 1, [], [0]),
        ("a wanted pod without a pod uses the slot", {0: OVER}, pods(3, absent=[1]), 1, [], [0]),
        (
            "a terminating excess pod uses the slot",
            {0: OVER},
            pods(2) + pods(3, terminating=[2])[2:],
            1,
            [],
            [0],
        ),
        ("the rest of the slots are used", {0: OVER, 1: OVER + GiB}, pods(3, not_ready=[2]), 2, [1], [0]),
        ("more down than allowed: nothing", {0: OVER}, pods(4, not_ready=[1, 2]), 1, [], [0]),
    ],
)
def test_max_unavailable(case, over, fleet, max_unavailable, restarted, held):
    memory = spec(max_unavailable=max_unavailable)
    decision = decide(breaching(over, memory), fleet, 0.0, memory, desired=3)
    assert [r.pod for r in decision.restart] == [name(i) for i in restarted], case
    assert [(h.pod, h.reason) for h in decision.held] == [(name(i), MAX_UNAVAILABLE) for i in held], case


def test_unavailable_counting():
    assert count_unavailable(pods(3)) == 0
    assert count_unavailable(pods(3, not_ready=[0], terminating=[1])) == 2
    assert count_unavailable(pods(3, absent=[2])) == 0  # without `desired`, absence is unknown
    assert count_unavailable(pods(3, absent=[2]), desired=3) == 1
    assert count_unavailable([], desired=2) == 2


def test_a_pod_that_is_not_serving_is_never_restarted():
    """A stale streak (the pod went terminating after the samples) does not restart it."""
    state = breaching({0: OVER})
    decision = decide(state, pods(2, terminating=[0]), 0.0, spec(max_unavailable=2), desired=2)
    assert decision.restart == () and decision.held == ()


def test_the_restart_carries_what_the_event_needs():
    decision = decide(breaching({0: OVER}), pods(1), 0.0, SPEC, desired=1)
    assert decision.restart == (Restart(name(0), OVER, 3, 1, 300),)
    message = restart_message(decision.restart[0], SPEC)
    assert name(0) in message and "5.0 GiB" in message and "4.0 GiB" in message and "300s" in message


# --- cooldown and backoff ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cooldown", "cap", "restart_number", "expected"),
    [
        (300, 3600, 1, 300),
        (300, 3600, 2, 600),
        (300, 3600, 3, 1200),
        (300, 3600, 4, 2400),
        (300, 3600, 5, 3600),
        (300, 3600, 6, 3600),
        (300, 3600, 500, 3600),
        (300, 100, 3, 300),  # a cap below the base cooldown never lowers it
        (0, 3600, 4, 0),
    ],
)
def test_cooldown_doubles_up_to_the_cap(cooldown, cap, restart_number, expected):
    assert cooldown_after(restart_number, spec(cooldown_s=cooldown, max_cooldown_s=cap)) == expected


def test_a_proxy_that_never_fits_is_restarted_ever_more_rarely():
    """The live set is larger than the budget: every replacement breaches again at once. The pod is
    unpolled for one cycle after each restart (terminating, then replaced)."""
    memory = spec(cooldown_s=120, max_cooldown_s=480)
    state, restarts, reasons = FleetMemoryState(), [], []
    unpolled_until = -1.0
    for cycle in range(100):
        now = cycle * INTERVAL
        polled = now > unpolled_until
        state = observe(state, {name(0): RssSample(OVER)} if polled else {}, now, memory)
        decision = decide(state, pods(1, not_ready=[] if polled else [0]), now, memory, desired=1)
        reasons += [h.reason for h in decision.held]
        for restart in decision.restart:
            state = record_restart(state, restart.pod, restart.rss_bytes, now, memory)
            restarts.append((now, restart.restart_number, restart.cooldown_s))
            unpolled_until = now + INTERVAL
        if decision.in_backoff:
            assert memory_condition(decision).reason == "Backoff"
    # Cooldowns 120, 240, 480 (cap), 480; each restart as soon as the previous cooldown is over.
    assert restarts[:5] == [(30, 1, 120), (150, 2, 240), (390, 3, 480), (870, 4, 480), (1350, 5, 480)]
    assert COOLDOWN in reasons and BACKOFF in reasons


def test_holds_report_the_end_of_the_cooldown():
    state = record_restart(breaching({0: OVER}), name(0), OVER, 0.0, SPEC)  # cooldown until 300
    for cycle in range(3):
        state = observe(state, {name(0): RssSample(OVER)}, 60.0 + cycle * INTERVAL, SPEC)
    decision = decide(state, pods(1), 100.0, SPEC, desired=1)
    assert decision.restart == ()
    assert decision.held == (Hold(name(0), COOLDOWN, OVER, 300.0, 1),)
    assert decision.in_backoff == decision.held and decision.under_pressure
    assert "200s left" in hold_message(decision.held[0], SPEC, 100.0)
    # Once the cooldown is over it is restarted (the streak kept counting meanwhile).
    state = observe(state, {name(0): RssSample(OVER)}, 300.0, SPEC)
    assert [r.restart_number for r in decide(state, pods(1), 300.0, SPEC, desired=1).restart] == [2]


@pytest.mark.parametrize(
    ("case", "quiet_s", "expected_number"),
    [
        ("quiet for the whole quiet period: counting starts again", 3600, 1),
        ("quiet for longer", 7200, 1),
        ("quiet for less: backoff continues", 3000, 3),
    ],
)
def test_backoff_resets_after_a_quiet_period(case, quiet_s, expected_number):
    assert quiet_period_s(SPEC) == 3600
    state = record_restart(FleetMemoryState(), name(0), OVER, 0.0, SPEC)
    state = record_restart(state, name(0), OVER, 1000.0, SPEC)
    start = 1100.0
    now = start
    while now <= start + quiet_s:  # within budget the whole time, with a failed poll in between
        state = observe(state, {name(0): RssSample(UNDER) if now != start + 30 else FAIL}, now, SPEC)
        now += INTERVAL
    for _ in range(SPEC.consecutive_samples):
        state = observe(state, {name(0): RssSample(OVER)}, now, SPEC)
        now += INTERVAL
    decision = decide(state, pods(1), now, SPEC, desired=1)
    assert [r.restart_number for r in decision.restart] == [expected_number], case


def test_records_survive_the_pod_being_gone_and_retain_drops_scaled_away_names():
    state = record_restart(FleetMemoryState(), name(0), OVER, 0.0, SPEC)
    state = record_restart(state, name(3), OVER, 0.0, SPEC)
    state = observe(state, {}, INTERVAL, SPEC)  # neither polled: both gone for a moment
    assert state.record(name(0)).restarts_in_window == 1
    assert set(retain(state, {name(0), name(1)}).pods) == {name(0)}


# --- poll failures, dry run, disabled ------------------------------------------------------------


def test_poll_failures_are_reported_never_acted_on_and_cleared_by_a_success():
    memory = spec(consecutive_samples=1)
    state = FleetMemoryState()
    for cycle in range(REPORTED_POLL_FAILURES):
        decision = decide(state, pods(2), cycle * INTERVAL, memory, desired=2)
        assert decision.poll_failures == ()
        state = observe(state, {name(0): FAIL, name(1): RssSample(UNDER)}, cycle * INTERVAL, memory)
    decision = decide(state, pods(2), 100.0, memory, desired=2)
    assert decision.restart == () and decision.held == ()
    assert decision.poll_failures == (PollTrouble(name(0), REPORTED_POLL_FAILURES, FAIL.reason),)
    condition = memory_condition(decision)
    assert (condition.status, condition.reason) == ("Unknown", "PollFailures")
    assert name(0) in condition.message and FAIL.reason in condition.message
    state = observe(state, {name(0): RssSample(UNDER), name(1): RssSample(UNDER)}, 120.0, memory)
    assert decide(state, pods(2), 120.0, memory, desired=2).poll_failures == ()


def test_dry_run_reports_and_never_restarts():
    memory = spec(dry_run=True)
    state = breaching({0: OVER, 1: OVER + GiB}, memory)
    for cycle in range(3):  # nothing is recorded, so it is reported again every cycle
        now = cycle * INTERVAL
        state = observe(state, {name(0): RssSample(OVER), name(1): RssSample(OVER + GiB)}, now, memory)
        decision = decide(state, pods(2), now, memory, desired=2)
        assert decision.restart == ()
        assert [(h.pod, h.reason) for h in decision.held] == [(name(1), DRY_RUN), (name(0), MAX_UNAVAILABLE)]
        assert [h.pod for h in decision.would_restart] == [name(1)]
    condition = memory_condition(decision)
    assert (condition.status, condition.reason) == ("True", "OverBudget")
    assert f"dry run, would restart: {name(1)}" in condition.message
    assert "would restart" in hold_message(decision.would_restart[0], memory, 0.0)


def test_budget_zero_disables_the_watchdog():
    memory = spec(rss_budget_bytes=0)
    state = breaching({0: 100 * GiB}, SPEC)  # a streak from before it was turned off
    state = observe(state, {name(0): RssSample(100 * GiB)}, 0.0, memory)
    assert state.record(name(0)).consecutive_breaches == 0
    decision = decide(state, pods(1), 0.0, memory, desired=1)
    assert decision == Decision(enabled=False)
    assert memory_condition(decision, 4) == Condition(
        MEMORY_PRESSURE, "False", "Disabled", "no RSS budget: the memory watchdog is off", "", 4
    )


# --- the condition and the status record ---------------------------------------------------------


RESTARTING = Restart(name(0), OVER, 3, 1, 300)
TROUBLE = PollTrouble(name(2), 5, "HTTP 500")


def held(ordinal: int, reason: str) -> Hold:
    return Hold(name(ordinal), reason, OVER, None, 2)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("case", "decision", "status", "reason", "in_message"),
    [
        ("all within", Decision(True), "False", "WithinBudget", "within"),
        ("restarting", Decision(True, restart=(RESTARTING,)), "True", "OverBudget", "restarting: f-proxy-0"),
        (
            "waiting for a slot",
            Decision(True, held=(held(1, MAX_UNAVAILABLE),)),
            "True",
            "OverBudget",
            "maxUnavailable: f-proxy-1",
        ),
        ("cooldown", Decision(True, held=(held(1, COOLDOWN),)), "True", "Backoff", "f-proxy-1 (2 memory"),
        (
            "backoff wins over the rest",
            Decision(True, restart=(RESTARTING,), held=(held(1, BACKOFF),)),
            "True",
            "Backoff",
            "restarting: f-proxy-0",
        ),
        (
            "pressure wins over poll failures",
            Decision(True, held=(held(1, DRY_RUN),), poll_failures=(TROUBLE,)),
            "True",
            "OverBudget",
            "f-proxy-2 (HTTP 500)",
        ),
        (
            "poll failures alone",
            Decision(True, poll_failures=(TROUBLE,)),
            "Unknown",
            "PollFailures",
            "f-proxy-2",
        ),
    ],
)
def test_memory_condition(case, decision, status, reason, in_message):
    condition = memory_condition(decision, generation=7)
    assert (condition.type, condition.status, condition.reason) == (MEMORY_PRESSURE, status, reason), case
    assert in_message in condition.message and condition.observed_generation == 7
    # No RSS values or countdowns: the message stays the same while the facts do.
    assert "GiB" not in condition.message and "left" not in condition.message


def test_the_condition_keeps_its_transition_time_and_the_other_conditions():
    ready = {"type": "Ready", "status": "True", "reason": "AllComponentsReady", "lastTransitionTime": "t0"}
    within = with_memory_condition([ready], Decision(enabled=True), "t1", 3)
    assert within[0] == ready and within[1]["lastTransitionTime"] == "t1"
    still = with_memory_condition(within, Decision(enabled=True), "t2", 4)
    assert still[1]["lastTransitionTime"] == "t1" and still[1]["observedGeneration"] == 4
    pressure = Decision(True, restart=(RESTARTING,))
    changed = with_memory_condition(still, pressure, "t3", 4)
    assert (changed[1]["status"], changed[1]["lastTransitionTime"]) == ("True", "t3")


def test_memory_restarts_status_counts_and_records_the_last():
    restart = Restart(name(1), OVER, 3, 1, 300)
    first = memory_restarts_status(None, restart, "2026-01-01T00:00:00Z")
    assert first == {"total": 1, "lastPod": name(1), "lastRssBytes": OVER, "lastTime": "2026-01-01T00:00:00Z"}
    assert memory_restarts_status(first, restart, "2026-01-01T00:05:00Z")["total"] == 2


# --- after an operator restart -------------------------------------------------------------------

WALL = datetime.datetime(2026, 1, 1, 1, 0, tzinfo=datetime.UTC).timestamp()


@pytest.mark.parametrize(
    ("case", "status", "seeded"),
    [
        ("a recent restart is seeded", {"lastPod": name(0), "lastTime": "2026-01-01T00:58:20Z"}, True),
        (
            "one older than the quiet period is not",
            {"lastPod": name(0), "lastTime": "2025-12-31T23:00:00Z"},
            False,
        ),
        ("no record", None, False),
        ("an unreadable time", {"lastPod": name(0), "lastTime": "yesterday"}, False),
    ],
)
def test_seed_from_status(case, status, seeded):
    now = 50.0  # a monotonic clock: WALL on the wall clock
    state = seed_from_status(FleetMemoryState(), status, now=now, wall_now=WALL, spec=SPEC)
    assert (name(0) in state.pods) == seeded, case
    if seeded:
        record = state.record(name(0))
        # 100 s ago on the wall clock is now - 100 on the state's clock.
        assert (record.last_restart_at, record.cooldown_until, record.restarts_in_window) == (-50.0, 250.0, 1)
        for cycle in range(3):
            state = observe(state, {name(0): RssSample(OVER)}, now + cycle, SPEC)
        assert [h.reason for h in decide(state, pods(1), now + 3, SPEC, desired=1).held] == [COOLDOWN]


def test_seed_never_overwrites_a_known_record():
    state = record_restart(FleetMemoryState(), name(0), OVER, 0.0, SPEC)
    status = {"lastPod": name(0), "lastTime": "2026-01-01T00:59:59Z"}
    assert seed_from_status(state, status, now=10.0, wall_now=WALL, spec=SPEC) == state


def test_a_restart_refused_by_the_disruption_budget_becomes_a_hold_without_cooldown():
    state = FleetMemoryState({})
    for step in range(3):
        state = observe(
            state, {name(0): RssSample(OVER), name(1): RssSample(OVER + GiB)}, step * INTERVAL, SPEC
        )
    decision = decide(state, pods(2), 3 * INTERVAL, spec(max_unavailable=2))
    assert [r.pod for r in decision.restart] == [name(1), name(0)]
    after = refused(decision, name(1))
    assert [r.pod for r in after.restart] == [name(0)]
    assert [(h.pod, h.reason, h.rss_bytes) for h in after.held] == [(name(1), DISRUPTION_BUDGET, OVER + GiB)]
    assert after.under_pressure and not after.in_backoff
    condition = memory_condition(after)
    assert (condition.status, condition.reason) == ("True", "OverBudget")
    assert f"eviction refused by the PodDisruptionBudget: {name(1)}" in condition.message
    message = hold_message(after.held[0], SPEC, 0)
    assert "PodDisruptionBudget refused the eviction" in message
    # Not recorded: the next cycle decides it again, with no cooldown.
    again = decide(state, pods(2), 4 * INTERVAL, spec(max_unavailable=2))
    assert name(1) in [r.pod for r in again.restart]
