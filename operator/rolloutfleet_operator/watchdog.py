"""The memory watchdog's decisions: which proxies to restart for exceeding their RSS budget, and when.

Pure functions over frozen values: no I/O and no clock reads. `now` is a float of seconds on one
clock of the caller's choice (monotonic or epoch), the same for every call on one state. A cycle:

    state = observe(state, samples, now, spec)           # one sample per proxy polled this cycle
    decision = decide(state, pods, now, spec, desired)   # what to restart, what is held back and why
    for restart in decision.restart:                     # eviction of restart.pod, then
        state = record_restart(state, restart.pod, restart.rss_bytes, now, spec)
        # or, when the PodDisruptionBudget refused it: decision = refused(decision, restart.pod)

Semantics (spec = `fleet.MemorySpec`):
- Poll only proxies that are Ready and not terminating. A sample is the RSS a proxy reported on
  `/stats`, or a poll failure. A proxy is *over budget* after `consecutive_samples` samples in a
  row with RSS strictly above `rss_budget_bytes`; one sample at or below the budget ends the streak.
- A failed poll never counts as a breach and never restarts anything: it neither extends nor ends
  the streak (a slow `/stats` says nothing about RSS either way). Consecutive failures are counted
  and, from `REPORTED_POLL_FAILURES` on, reported.
- A proxy that was not polled in a cycle (not Ready, terminating, gone) starts both streaks anew:
  the next process under its name may be a new one.
- Restarts never take the fleet past `max_unavailable`: pods that are not Ready or terminating,
  and wanted ordinals that have no pod (a deleted pod between its exit and its replacement),
  count as unavailable already. Over-budget proxies are restarted highest RSS first.
- A restart is an eviction (the caller's): a PodDisruptionBudget that refuses it (a node drain or
  a roll took the room between the decision and the eviction) turns it into a hold
  (DisruptionBudget, `refused`), with no cooldown, tried again next cycle.
- Backoff: restart n of a proxy within its backoff window is followed by a cooldown of
  min(cooldown_s * 2**(n-1), max_cooldown_s), during which it is not restarted again (it is held
  with reason Cooldown, or Backoff from the second restart on). So a proxy whose live set simply
  exceeds the budget is restarted ever more rarely, at least once per max_cooldown_s, instead of
  in a loop. The cap never lowers the base cooldown (if max_cooldown_s < cooldown_s, the cooldown
  is cooldown_s). The window closes, and n starts again at 1, once the proxy has stayed at or below
  the budget for `quiet_period_s(spec)` = max(max_cooldown_s, cooldown_s) seconds in a row.
- Records are keyed by pod name, which is stable across restarts (`<fleet>-proxy-<i>`), so the
  backoff of a proxy carries over to its replacement.
- Dry run: the same decision is made, but the proxies that would be restarted are held with
  reason DryRun, and no restart is recorded (so no cooldown starts).
- rss_budget_bytes == 0 turns the watchdog off: nothing is observed or decided.

The state lives in the operator's memory between cycles. After an operator restart it starts
empty, which is conservative: streaks start again (restarts are only delayed), and backoff history
is lost except for the last restart, which `seed_from_status` rebuilds from the fleet's status.
"""

from __future__ import annotations

import datetime
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from .conditions import MAX_NAMES_IN_MESSAGE, Condition, set_condition
from .fleet import MemorySpec
from .plan import ProxyPodView

MEMORY_PRESSURE = "MemoryPressure"
STORAGE_WRITABLE = "StorageWritable"
# From this many failed polls in a row, a proxy's poll failures show in the condition.
REPORTED_POLL_FAILURES = 3
# 2**64 times any cooldown is beyond every cap; bounding the exponent keeps the numbers small.
_MAX_BACKOFF_EXPONENT = 64

HoldReason = Literal["Cooldown", "Backoff", "MaxUnavailable", "DisruptionBudget", "DryRun"]
COOLDOWN: HoldReason = "Cooldown"
BACKOFF: HoldReason = "Backoff"
MAX_UNAVAILABLE: HoldReason = "MaxUnavailable"
# Restarted by the decision, but the Eviction API refused (429): the PodDisruptionBudget allows no
# disruption now (a node drain or a roll took the room first). Tried again next cycle.
DISRUPTION_BUDGET: HoldReason = "DisruptionBudget"
DRY_RUN: HoldReason = "DryRun"


# --- samples and state ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RssSample:
    """A successful poll: the RSS the proxy reported, and why it cannot persist (None: it can)."""

    rss_bytes: int
    storage_error: str | None = None


@dataclass(frozen=True)
class PollFailure:
    """A failed poll (timeout, refused, non-200, malformed answer), with a short reason."""

    reason: str


Sample = RssSample | PollFailure


@dataclass(frozen=True)
class PodMemoryRecord:
    """What the watchdog remembers about one proxy pod name."""

    consecutive_breaches: int = 0  # samples above budget in a row (poll failures do not count)
    last_rss_bytes: int | None = None  # the last reported RSS, None before the first sample
    consecutive_poll_failures: int = 0
    last_poll_failure: str | None = None  # the reason of the last failed poll
    restarts_in_window: int = 0  # memory restarts since the proxy last stayed quiet long enough
    cooldown_until: float | None = None  # no memory restart before this time
    last_restart_at: float | None = None
    within_budget_since: float | None = None  # start of the current run of samples within budget


@dataclass(frozen=True)
class FleetMemoryState:
    """The watchdog's memory of one fleet: pod name -> record. Never mutated; every update copies."""

    pods: Mapping[str, PodMemoryRecord] = field(default_factory=dict)

    def record(self, pod: str) -> PodMemoryRecord:
        return self.pods.get(pod) or PodMemoryRecord()

    def _with(self, updates: Mapping[str, PodMemoryRecord]) -> FleetMemoryState:
        return FleetMemoryState({**self.pods, **updates})


def cooldown_after(restart_number: int, spec: MemorySpec) -> int:
    """Seconds without memory restarts after restart `restart_number` (1-based) in the window."""
    exponent = min(max(restart_number, 1) - 1, _MAX_BACKOFF_EXPONENT)
    cap = max(spec.max_cooldown_s, spec.cooldown_s)
    backoff: int = 2**exponent  # exponent >= 0: an int (typeshed's int.__pow__ cannot tell)
    return min(spec.cooldown_s * backoff, cap)


def quiet_period_s(spec: MemorySpec) -> int:
    """How long a proxy stays within budget before its backoff count starts again."""
    return max(spec.max_cooldown_s, spec.cooldown_s)


def observe(
    state: FleetMemoryState, samples: Mapping[str, Sample], now: float, spec: MemorySpec
) -> FleetMemoryState:
    """`state` updated with one cycle's samples (pod name -> sample, for every pod polled).

    Pods with a record but no sample were not polled: their streaks start anew. Their restart
    history (count, cooldown) is kept, so it carries over to their replacement.
    """
    updates: dict[str, PodMemoryRecord] = {}
    for pod, record in state.pods.items():
        if pod not in samples or not spec.enabled:
            updates[pod] = replace(record, consecutive_breaches=0, consecutive_poll_failures=0)
    if not spec.enabled:
        return state._with(updates)
    for pod, sample in samples.items():
        record = state.record(pod)
        if isinstance(sample, PollFailure):
            updates[pod] = replace(
                record,
                consecutive_poll_failures=record.consecutive_poll_failures + 1,
                last_poll_failure=sample.reason,
            )
        elif sample.rss_bytes > spec.rss_budget_bytes:
            updates[pod] = replace(
                record,
                consecutive_breaches=record.consecutive_breaches + 1,
                last_rss_bytes=sample.rss_bytes,
                consecutive_poll_failures=0,
                within_budget_since=None,
            )
        else:
            since = now if record.within_budget_since is None else record.within_budget_since
            restarts = record.restarts_in_window
            if now - since >= quiet_period_s(spec):
                restarts = 0  # quiet long enough: the next breach is a first one again
            updates[pod] = replace(
                record,
                consecutive_breaches=0,
                last_rss_bytes=sample.rss_bytes,
                consecutive_poll_failures=0,
                within_budget_since=since,
                restarts_in_window=restarts,
            )
    return state._with(updates)


def record_restart(
    state: FleetMemoryState, pod: str, rss_bytes: int, now: float, spec: MemorySpec
) -> FleetMemoryState:
    """`state` after `pod` was deleted for memory (call only once the deletion was accepted)."""
    record = state.record(pod)
    number = record.restarts_in_window + 1
    restarted = replace(
        record,
        consecutive_breaches=0,
        last_rss_bytes=rss_bytes,
        consecutive_poll_failures=0,
        restarts_in_window=number,
        cooldown_until=now + cooldown_after(number, spec),
        last_restart_at=now,
        within_budget_since=None,
    )
    return state._with({pod: restarted})


def retain(state: FleetMemoryState, pod_names: Collection[str]) -> FleetMemoryState:
    """`state` without the records of other pod names.

    Pass the names of the wanted ordinals (below spec.proxy.replicas), not the pods that exist: a
    restarted pod is absent for a moment between its exit and its replacement, and its backoff
    must survive that. Dropping scaled-away names keeps the state as small as the fleet.
    """
    return FleetMemoryState({pod: record for pod, record in state.pods.items() if pod in pod_names})


def seed_from_status(
    state: FleetMemoryState,
    memory_restarts: Mapping[str, Any] | None,
    *,
    now: float,
    wall_now: float,
    spec: MemorySpec,
) -> FleetMemoryState:
    """`state` with the cooldown of the last memory restart in the fleet's status
    (`status.memoryRestarts`: lastPod, lastTime) restored, after an operator restart.

    `wall_now` is the epoch time matching `now` (they may be the same clock), so a state kept in
    monotonic time can be seeded from the wall-clock timestamp. Only the last restart is known, so
    it is seeded as restart 1 of its window. Pods that already have a record, restarts older than
    the quiet period and unreadable records leave the state as it is.
    """
    pod = (memory_restarts or {}).get("lastPod")
    stamp = (memory_restarts or {}).get("lastTime")
    if not isinstance(pod, str) or not isinstance(stamp, str) or not pod or pod in state.pods:
        return state
    try:
        restarted_wall = datetime.datetime.fromisoformat(stamp).timestamp()
    except ValueError:
        return state
    age = max(0.0, wall_now - restarted_wall)
    if age >= quiet_period_s(spec):
        return state
    restarted_at = now - age
    record = PodMemoryRecord(
        restarts_in_window=1,
        cooldown_until=restarted_at + cooldown_after(1, spec),
        last_restart_at=restarted_at,
    )
    return state._with({pod: record})


# --- the decision --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Restart:
    """A proxy to delete gracefully this cycle."""

    pod: str
    rss_bytes: int
    breaches: int  # samples over budget in a row
    restart_number: int  # this restart's number within the backoff window (1 = first)
    cooldown_s: int  # the cooldown that follows it


@dataclass(frozen=True)
class Hold:
    """An over-budget proxy not restarted this cycle, and why."""

    pod: str
    reason: HoldReason
    rss_bytes: int
    until: float | None = None  # the end of its cooldown (Cooldown and Backoff), else None
    restarts_in_window: int = 0


@dataclass(frozen=True)
class PollTrouble:
    """A proxy whose last `failures` polls failed (at least REPORTED_POLL_FAILURES)."""

    pod: str
    failures: int
    reason: str


@dataclass(frozen=True)
class Decision:
    enabled: bool
    restart: tuple[Restart, ...] = ()
    held: tuple[Hold, ...] = ()
    poll_failures: tuple[PollTrouble, ...] = ()
    unavailable: int = 0  # proxies already down when the decision was made
    dry_run: bool = False

    @property
    def under_pressure(self) -> bool:
        """Some proxy is over budget (restarted now or held back)."""
        return bool(self.restart or self.held)

    @property
    def in_backoff(self) -> tuple[Hold, ...]:
        """Over-budget proxies waiting out the cooldown of an earlier memory restart."""
        return tuple(h for h in self.held if h.reason in (COOLDOWN, BACKOFF))

    @property
    def would_restart(self) -> tuple[Hold, ...]:
        """In dry run: the proxies that would have been restarted."""
        return tuple(h for h in self.held if h.reason == DRY_RUN)


def count_unavailable(pods: Iterable[ProxyPodView], desired: int | None = None) -> int:
    """Proxies down now: pods not Ready or terminating, plus wanted ordinals without a pod."""
    pods = list(pods)
    down = sum(1 for p in pods if p.deleting or not p.ready)
    present = {p.ordinal for p in pods}
    missing = 0 if desired is None else sum(1 for i in range(desired) if i not in present)
    return down + missing


def decide(
    state: FleetMemoryState,
    pods: Sequence[ProxyPodView],
    now: float,
    spec: MemorySpec,
    desired: int | None = None,
) -> Decision:
    """The restarts of this cycle. `pods`: every proxy pod of the fleet from this cycle's list;
    `desired`: spec.proxy.replicas, so that wanted ordinals without a pod count as unavailable."""
    if not spec.enabled:
        return Decision(enabled=False)
    serving = {p.name for p in pods if p.ready and not p.deleting}
    troubles = tuple(
        PollTrouble(pod, record.consecutive_poll_failures, record.last_poll_failure or "")
        for pod, record in sorted(state.pods.items())
        if pod in serving and record.consecutive_poll_failures >= REPORTED_POLL_FAILURES
    )
    due = [
        (pod, record)
        for pod, record in state.pods.items()
        if pod in serving and record.consecutive_breaches >= spec.consecutive_samples
    ]
    due.sort(key=lambda item: (-(item[1].last_rss_bytes or 0), item[0]))
    held: list[Hold] = []
    ready_to_restart: list[tuple[str, PodMemoryRecord]] = []
    for pod, record in due:
        rss = record.last_rss_bytes or 0
        if record.cooldown_until is not None and now < record.cooldown_until:
            reason = BACKOFF if record.restarts_in_window >= 2 else COOLDOWN
            held.append(Hold(pod, reason, rss, record.cooldown_until, record.restarts_in_window))
        else:
            ready_to_restart.append((pod, record))
    unavailable = count_unavailable(pods, desired)
    room = max(0, spec.max_unavailable - unavailable)
    restart: list[Restart] = []
    for index, (pod, record) in enumerate(ready_to_restart):
        rss = record.last_rss_bytes or 0
        if index >= room:
            held.append(Hold(pod, MAX_UNAVAILABLE, rss, None, record.restarts_in_window))
        elif spec.dry_run:
            held.append(Hold(pod, DRY_RUN, rss, None, record.restarts_in_window))
        else:
            number = record.restarts_in_window + 1
            restart.append(
                Restart(pod, rss, record.consecutive_breaches, number, cooldown_after(number, spec))
            )
    return Decision(
        enabled=True,
        restart=tuple(restart),
        held=tuple(held),
        poll_failures=troubles,
        unavailable=unavailable,
        dry_run=spec.dry_run,
    )


def refused(decision: Decision, pod: str) -> Decision:
    """`decision` after the eviction of `pod` was refused by its PodDisruptionBudget: no longer a
    restart of this cycle, but held (DisruptionBudget), so it is not recorded and no cooldown starts."""
    kept = tuple(r for r in decision.restart if r.pod != pod)
    held = tuple(
        Hold(r.pod, DISRUPTION_BUDGET, r.rss_bytes, None, r.restart_number - 1)
        for r in decision.restart
        if r.pod == pod
    )
    return replace(decision, restart=kept, held=decision.held + held)


# --- status, conditions, Events ------------------------------------------------------------------


def format_bytes(count: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"


def _listed(items: Sequence[str]) -> str:
    shown = ", ".join(items[:MAX_NAMES_IN_MESSAGE])
    more = len(items) - MAX_NAMES_IN_MESSAGE
    return f"{shown} and {more} more" if more > 0 else shown


def _seconds_left(until: float | None, now: float) -> int:
    return max(0, round((until or now) - now))


def restart_message(restart: Restart, spec: MemorySpec) -> str:
    """The message of the Event for a memory restart."""
    return (
        f"restarting {restart.pod}: RSS {format_bytes(restart.rss_bytes)} over the budget of "
        f"{format_bytes(spec.rss_budget_bytes)} for {restart.breaches} samples; restart "
        f"{restart.restart_number} in its backoff window, no memory restart for {restart.cooldown_s}s"
    )


def hold_message(hold: Hold, spec: MemorySpec, now: float) -> str:
    """The message of the Event for an over-budget proxy that is not restarted this cycle."""
    budget = format_bytes(spec.rss_budget_bytes)
    over = f"{hold.pod}: RSS {format_bytes(hold.rss_bytes)} over the budget of {budget}"
    if hold.reason in (COOLDOWN, BACKOFF):
        return (
            f"{over}; not restarted: {hold.reason.lower()} after {hold.restarts_in_window} memory "
            f"restart(s), {_seconds_left(hold.until, now)}s left"
        )
    if hold.reason == MAX_UNAVAILABLE:
        return f"{over}; not restarted yet: maxUnavailable ({spec.max_unavailable}) proxies are down"
    if hold.reason == DISRUPTION_BUDGET:
        return f"{over}; not restarted yet: its PodDisruptionBudget refused the eviction (a drain or a roll)"
    return f"{over}; dry run: would restart it"


def memory_condition(decision: Decision, generation: int = 0) -> Condition:
    """The fleet's MemoryPressure condition (lastTransitionTime is left to `set_condition`).

    True (Backoff): an over-budget proxy waits out the cooldown of an earlier memory restart; True
    (OverBudget): proxies are over budget and restarted now, waiting for maxUnavailable or for their
    PodDisruptionBudget (eviction refused), or would be restarted (dry run); Unknown (PollFailures):
    none is known to be over budget but some could not be polled REPORTED_POLL_FAILURES times in a
    row; False (WithinBudget); False (Disabled): no budget.
    The message lists every fact, whatever the reason, but no RSS values or countdowns: those change
    every cycle and would rewrite the status each time (they go to Events and metrics).
    """
    if not decision.enabled:
        message = "no RSS budget: the memory watchdog is off"
        return Condition(MEMORY_PRESSURE, "False", "Disabled", message, "", generation)
    parts = []
    if decision.in_backoff:
        items = [f"{h.pod} ({h.restarts_in_window} memory restarts)" for h in decision.in_backoff]
        parts.append(f"over budget in cooldown: {_listed(items)}")
    if decision.restart:
        parts.append(f"restarting: {_listed([r.pod for r in decision.restart])}")
    waiting = [h.pod for h in decision.held if h.reason == MAX_UNAVAILABLE]
    if waiting:
        parts.append(f"over budget, waiting for maxUnavailable: {_listed(waiting)}")
    refused_now = [h.pod for h in decision.held if h.reason == DISRUPTION_BUDGET]
    if refused_now:
        parts.append(f"over budget, eviction refused by the PodDisruptionBudget: {_listed(refused_now)}")
    if decision.would_restart:
        parts.append(f"dry run, would restart: {_listed([h.pod for h in decision.would_restart])}")
    if decision.poll_failures:
        items = [f"{t.pod} ({t.reason})" for t in decision.poll_failures]
        parts.append(f"repeated poll failures: {_listed(items)}")
    message = "; ".join(parts) or "every polled proxy is within its RSS budget"
    if decision.in_backoff:
        return Condition(MEMORY_PRESSURE, "True", "Backoff", message, "", generation)
    if decision.under_pressure:
        return Condition(MEMORY_PRESSURE, "True", "OverBudget", message, "", generation)
    if decision.poll_failures:
        return Condition(MEMORY_PRESSURE, "Unknown", "PollFailures", message, "", generation)
    return Condition(MEMORY_PRESSURE, "False", "WithinBudget", message, "", generation)


@dataclass(frozen=True)
class StorageReport:
    """What a proxy pod last said about its dump volume (its /stats `storage`)."""

    uid: str  # the pod's: a replacement under the same name starts without a report
    error: str | None  # why it cannot persist; None: it can


def storage_reports(
    previous: Mapping[str, StorageReport], samples: Mapping[str, Sample], uids: Mapping[str, str]
) -> dict[str, StorageReport]:
    """The last storage report of each existing pod (`uids`: pod name -> uid): this cycle's answer,
    else the one kept from before for the same pod. A failed poll (a proxy busy, restarting) keeps
    the last report; a pod that is gone or replaced drops it."""
    reports = {}
    for pod, uid in uids.items():
        sample = samples.get(pod)
        if isinstance(sample, RssSample):
            reports[pod] = StorageReport(uid, sample.storage_error)
        elif pod in previous and previous[pod].uid == uid:
            reports[pod] = previous[pod]
    return reports


def storage_condition(
    reports: Mapping[str, StorageReport], generation: int = 0, enabled: bool = True
) -> Condition:
    """The fleet's StorageWritable condition from the proxies' own reports (Ready or not: a proxy
    that cannot write fails /readyz but still answers /stats): False (CannotPersist) naming each
    proxy whose dump volume refuses writes and why (those proxies refuse new sessions and turns with
    503 until it recovers), True (Writable) otherwise, Unknown (NotPolled) when no proxy has answered
    yet, Unknown (WatchdogOff) when nothing is polled because the watchdog is off."""
    if not enabled:
        message = "no RSS budget: the memory watchdog is off and polls no proxy"
        return Condition(STORAGE_WRITABLE, "Unknown", "WatchdogOff", message, "", generation)
    failing = sorted((pod, r.error) for pod, r in reports.items() if r.error)
    if failing:
        items = [f"{pod} ({why})" for pod, why in failing]
        return Condition(
            STORAGE_WRITABLE,
            "False",
            "CannotPersist",
            f"cannot write their dumps: {_listed(items)}",
            "",
            generation,
        )
    if not reports:
        return Condition(
            STORAGE_WRITABLE, "Unknown", "NotPolled", "no proxy answered a stats poll", "", generation
        )
    return Condition(
        STORAGE_WRITABLE,
        "True",
        "Writable",
        f"all {len(reports)} polled proxies can persist",
        "",
        generation,
    )


def with_memory_condition(
    conditions: Sequence[dict[str, Any]], decision: Decision, timestamp: str, generation: int
) -> list[dict[str, Any]]:
    """`conditions` with MemoryPressure set from `decision` (`timestamp`: RFC 3339, used as
    lastTransitionTime when the status changes; other condition types are kept)."""
    return set_condition(conditions, memory_condition(decision, generation), timestamp)


def memory_restarts_status(
    previous: Mapping[str, Any] | None, restart: Restart, timestamp: str
) -> dict[str, Any]:
    """`status.memoryRestarts` after `restart` (`timestamp`: RFC 3339 of the deletion)."""
    total = int((previous or {}).get("total") or 0) + 1
    return {"total": total, "lastPod": restart.pod, "lastRssBytes": restart.rss_bytes, "lastTime": timestamp}
