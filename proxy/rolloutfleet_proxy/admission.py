"""Staleness-bounded admission of new sessions: the capacity arithmetic, as pure functions.

The model follows AReaL's staleness manager, per proxy. Each session is one rollout:

- *enqueued*: sessions created (AReaL's "submitted");
- *running*: sessions created and not yet finished or ended (restored unfinished sessions included);
- *accepted*: sessions finished, i.e. trajectories produced, since counting started;
- *rejected*: sessions that ended without producing a trajectory (deleted, or evicted unfinished):
  they leave *running* and never reach *accepted*, as AReaL's `on_rollout_rejected`.

The trainer consumes `batch` trajectories per model version, so by version `v` it has consumed about
`v * batch` of them; every accepted trajectory beyond that is still waiting to be trained on. A new
rollout started now is trained on at the latest `max_staleness` versions later only if

    accepted + running < (max_staleness + v + 1) * batch

Each proxy applies the bound to its own share of the batch (`batch_share`, batch / replicas).

The arithmetic only holds while `accepted` is anchored to the version: a counter that restarts at
0 while the version is 268 admits (max_staleness + 269) * batch rollouts at once (a public RL
proxy shipped that bug). So whenever counting (re)starts, `accepted` is *rebased* to
`version * share` plus the trajectories produced but not yet consumed (see `rebased_accepted`).
"""

from __future__ import annotations

from dataclasses import dataclass

# Retry-After hints (seconds) for a refused session: running sessions finish within seconds to
# minutes, while the staleness bound only moves when the trainer publishes a new model version.
CONCURRENCY_RETRY_AFTER_S = 1
STALENESS_RETRY_AFTER_S = 5


@dataclass(frozen=True)
class AdmissionLimits:
    """The configured bounds. `max_staleness` None: no staleness bound; `max_concurrent` 0: none."""

    max_staleness: int | None
    batch_share: int
    max_concurrent: int

    @property
    def enabled(self) -> bool:
        return self.max_staleness is not None or self.max_concurrent > 0


def concurrency_capacity(max_concurrent: int, running: int) -> int | None:
    """New sessions the concurrency bound still admits; None when there is no such bound (0)."""
    if max_concurrent <= 0:
        return None
    return max_concurrent - running


def staleness_capacity(
    max_staleness: int | None, version: int, batch_share: int, accepted: int, running: int
) -> int | None:
    """New sessions the staleness bound still admits: (max_staleness + version + 1) * share minus
    every rollout already counted against it (accepted + running). None when there is no bound.
    Negative when over the bound (after a rebase, or when restored sessions exceed it)."""
    if max_staleness is None:
        return None
    return (max_staleness + version + 1) * max(1, batch_share) - (accepted + running)


def admission_capacity(limits: AdmissionLimits, version: int, accepted: int, running: int) -> int | None:
    """The smaller of both bounds (None: unbounded). A new session is admitted only when it is > 0."""
    bounds = [
        concurrency_capacity(limits.max_concurrent, running),
        staleness_capacity(limits.max_staleness, version, limits.batch_share, accepted, running),
    ]
    finite = [b for b in bounds if b is not None]
    return min(finite) if finite else None


def limiting_bound(limits: AdmissionLimits, version: int, accepted: int, running: int) -> str | None:
    """Which bound refuses a new session right now: "concurrency", "staleness", or None (admitted)."""
    concurrency = concurrency_capacity(limits.max_concurrent, running)
    if concurrency is not None and concurrency <= 0:
        return "concurrency"
    staleness = staleness_capacity(limits.max_staleness, version, limits.batch_share, accepted, running)
    if staleness is not None and staleness <= 0:
        return "staleness"
    return None


def rebased_accepted(version: int, batch_share: int, unconsumed: int) -> int:
    """`accepted` for counting that (re)starts at `version`: the `version * share` trajectories the
    trainer has consumed from this proxy by then, plus those produced but not yet consumed (ready
    sessions, exported batches not acknowledged). Capacity is then at most
    (max_staleness + 1) * share - unconsumed - running, whatever the version.

    A plain assignment, never max(persisted, ...): after a scale-up the share shrinks, and a
    persisted count from the old share would block this proxy for many versions."""
    return version * max(1, batch_share) + unconsumed


def is_training_step(old_version: int, new_version: int) -> bool:
    """One step forward (or the same version again): the trainer trained on one more batch.

    Any other move is a recovery: the trainer resumed from a checkpoint (a jump back, or forward over
    many versions), or this proxy is new to a fleet already at version 268 and hears the version for
    the first time."""
    return new_version in (old_version, old_version + 1)


def accepted_after_version_change(
    accepted: int, old_version: int, new_version: int, batch_share: int, unconsumed: int
) -> int:
    """`accepted` after the trainer sets the model version: unchanged across a training step, as in
    AReaL; after a recovery counting restarts at the new version, so it is rebased as on a restart."""
    if is_training_step(old_version, new_version):
        return accepted
    return rebased_accepted(new_version, batch_share, unconsumed)
