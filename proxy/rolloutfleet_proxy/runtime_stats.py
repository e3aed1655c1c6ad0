"""The `/stats` document (also the heartbeat's and the Prometheus collector's source): every part's
figures gathered into one JSON object."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from .stats import build_stats

if TYPE_CHECKING:
    from .runtime import ProxyRuntime


def admission_stats(runtime: ProxyRuntime) -> dict[str, Any]:
    limits, admission = runtime.limits, runtime.admission
    return {
        "enabled": limits.enabled,
        "max_staleness": limits.max_staleness,
        "batch_share": limits.batch_share,
        "max_concurrent_sessions": limits.max_concurrent,
        "capacity": runtime.versions.admission_capacity(),
        "enqueued": admission.enqueued,
        "running": runtime.store.running,
        "accepted": admission.accepted,
        "rejected": admission.rejected,
        "refused": admission.refused,
    }


def runtime_stats(runtime: ProxyRuntime) -> dict[str, Any]:
    store = runtime.store
    stats = build_stats(
        runtime.counters,
        runtime.gauges,
        len(store),
        store.detached_count,
        store.tokens_held,
        inflight_turns=runtime.in_flight.generating,
        draining=runtime.lifecycle.draining,
    )
    stats["loop_lag_max_seconds"] = round(runtime.loop_lag.max_s, 6)
    stats["loop_lag_recent_max_seconds"] = round(runtime.loop_lag.recent_max(time.monotonic()), 6)
    buffer = runtime.exports.buffer
    stats["model_version"] = runtime.generation.model_version
    stats["generation_paused"] = runtime.generation.paused
    stats["paused_turns"] = runtime.generation.waiting
    stats["ready_trajectories"] = store.ready_count
    stats["export_batches"] = len(buffer)
    stats["export_trajectories"] = buffer.trajectories
    stats["export_bytes"] = buffer.bytes
    stats["admission"] = admission_stats(runtime)
    stats.update(runtime.storage.stats())
    stats["sessions_lost"] = store.lost_count
    return stats
