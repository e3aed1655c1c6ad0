"""Counters, the /stats document, and the Prometheus view of the same numbers."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import psutil
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


@dataclass
class Counters:
    """Monotonic totals since this process started."""

    requests: int = 0
    requests_over_budget: int = 0  # refused with 503 request_budget_exhausted
    turns: int = 0
    turns_failed: int = 0
    turns_busy_rejected: int = 0
    turns_replayed: int = 0  # retried requests answered from the record, without the engine
    turns_cancelled: int = 0  # by a DELETE, the drain, or a client that disconnected
    turns_client_gone: int = 0  # cancelled because their client disconnected
    sessions_created: int = 0
    sessions_refused_memory: int = 0
    sessions_deleted: int = 0
    sessions_finished: int = 0
    sessions_dumped: int = 0
    sessions_drained: int = 0
    sessions_evicted: int = 0
    sessions_dropped: int = 0
    sessions_restored: int = 0
    dump_failures: int = 0
    restore_failures: int = 0
    cleanup_cycles: int = 0
    cleanup_errors: int = 0
    heap_trims: int = 0
    turns_pause_timeouts: int = 0
    turns_templated_off_loop: int = 0  # large turns templated and tokenized in a worker thread
    turns_continued: int = 0  # generations resubmitted after SGLang aborted them (tokens kept)
    generated_tokens_continued: int = 0  # tokens made before an abort and kept in their turn
    generated_tokens_discarded: int = 0  # tokens made before an abort, lost because the turn failed
    batches_exported: int = 0
    trajectories_exported: int = 0
    batches_acknowledged: int = 0
    batches_expired: int = 0
    batches_drained: int = 0
    batches_restored: int = 0
    batches_dropped: int = 0
    state_write_failures: int = 0
    compactions: int = 0  # journal compactions that retired their segments
    compaction_failures: int = 0
    sessions_lost: int = 0  # journaled sessions a restore could not rebuild (answer 410 session_lost)
    images_received: int = 0  # image parts of requests (history included), decoded and named
    images_stored: int = 0  # distinct images written to the image store (new to this proxy)
    image_bytes_stored: int = 0
    images_deleted: int = 0  # left the store: nothing referenced them any more
    image_mismatches: int = 0  # turns failed because the engine expanded images otherwise (502)


@dataclass
class AdmissionCounters:
    """AReaL-style rollout counts, persisted in the state file (not reset by a restart).

    `accepted` is rebased at start and on version jumps (see admission.py); `running` is not here:
    the store derives it from the sessions it holds."""

    enqueued: int = 0
    accepted: int = 0
    rejected: int = 0
    refused: int = 0


@dataclass
class Gauges:
    """Point-in-time values the app updates as it works."""

    request_bytes_in_flight: int = 0
    last_cleanup_seconds: float = 0.0
    trim_available: bool = False


_process = psutil.Process(os.getpid())


_rss_cache = [0.0, 0]  # [monotonic time read, bytes]


def recent_rss_bytes(max_age_s: float = 1.0) -> int:
    """This process's resident set size, read from /proc at most once per `max_age_s`: session
    creations check it on the event loop, and RSS moves slowly next to them."""
    now = time.monotonic()
    if now - _rss_cache[0] >= max_age_s:
        _rss_cache[:] = [now, _process.memory_info().rss]
    return int(_rss_cache[1])


_started = time.time()


def build_stats(
    counters: Counters,
    gauges: Gauges,
    live_sessions: int,
    detached_sessions: int,
    tokens_held: int,
    *,
    inflight_turns: int = 0,
    draining: bool = False,
) -> dict[str, Any]:
    memory = _process.memory_info()
    return {
        "pid": os.getpid(),
        "uptime_seconds": round(time.time() - _started, 3),
        "rss_bytes": memory.rss,
        "vms_bytes": memory.vms,
        "live_sessions": live_sessions,
        "sessions_being_written": detached_sessions,
        "tokens_held": tokens_held,
        "inflight_turns": inflight_turns,
        "request_bytes_in_flight": gauges.request_bytes_in_flight,
        "draining": draining,
        "last_cleanup_seconds": gauges.last_cleanup_seconds,
        "trim_available": gauges.trim_available,
        "totals": asdict(counters),
    }


_GAUGE_HELP = {
    "rss_bytes": "Resident set size of the proxy process",
    "vms_bytes": "Virtual memory size of the proxy process",
    "live_sessions": "Sessions held in memory and reachable",
    "sessions_being_written": "Sessions detached while their dump is written",
    "tokens_held": "Tokens held across all sessions",
    "inflight_turns": "Turns waiting on the upstream",
    "last_cleanup_seconds": "Duration of the last stale-session cleanup cycle",
    "uptime_seconds": "Seconds since the process started",
    "loop_lag_max_seconds": "Largest event-loop lag since the process started",
    "loop_lag_recent_max_seconds": "Largest event-loop lag in the last 10 seconds",
    "model_version": "Model version new turns are generated under",
    "paused_turns": "Turns waiting for generation to resume",
    "ready_trajectories": "Finished sessions held, waiting for export",
    "export_batches": "Exported batches held until the trainer acknowledges them",
    "export_trajectories": "Trajectories in exported batches not yet acknowledged",
    "export_bytes": "Bytes of exported batches not yet acknowledged",
    "storage_writable": "1 while the dump volume takes writes (0: sessions and turns are refused)",
    "journal_bytes": "Bytes in the write-ahead journal's segments (compaction bounds it)",
    "request_bytes_in_flight": "Request body bytes held by requests being handled",
}
_ADMISSION_GAUGES = {
    "running": "Sessions created and not yet finished or ended",
    "accepted": "Finished sessions counted against the staleness bound (rebased at start)",
    "capacity": "New sessions admission still accepts (+Inf: unbounded)",
}
_ADMISSION_COUNTERS = {
    "enqueued": "Total sessions admitted (created)",
    "rejected": "Total sessions that ended without producing a trajectory",
    "refused": "Total session creations refused by admission (429)",
}


class StatsCollector(Collector):
    """Renders the /stats document as Prometheus metrics at scrape time: one source for both views."""

    def __init__(self, stats: Callable[[], dict[str, Any]], prefix: str = "rolloutfleet_proxy"):
        self._stats = stats
        self._prefix = prefix

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        for name, help_text in _GAUGE_HELP.items():
            yield GaugeMetricFamily(f"{self._prefix}_{name}", help_text, value=float(stats[name]))
        yield GaugeMetricFamily(
            f"{self._prefix}_draining", "1 while draining for shutdown", value=float(stats["draining"])
        )
        yield GaugeMetricFamily(
            f"{self._prefix}_heap_trim_available",
            "1 when malloc_trim is usable",
            value=float(stats["trim_available"]),
        )
        yield GaugeMetricFamily(
            f"{self._prefix}_generation_paused",
            "1 while generation is paused",
            value=float(stats["generation_paused"]),
        )
        admission = stats["admission"]
        for name, help_text in _ADMISSION_GAUGES.items():
            value = admission[name]
            yield GaugeMetricFamily(
                f"{self._prefix}_admission_{name}",
                help_text,
                value=float("inf") if value is None else float(value),
            )
        for name, help_text in _ADMISSION_COUNTERS.items():
            yield CounterMetricFamily(f"{self._prefix}_admission_{name}", help_text, value=admission[name])
        for name in ("records", "syncs", "write_failures"):
            yield CounterMetricFamily(
                f"{self._prefix}_journal_{name}",
                f"Total journal {name.replace('_', ' ')}",
                value=stats["journal"][name],
            )
        yield CounterMetricFamily(
            f"{self._prefix}_storage_failures",
            "Times the dump volume turned unwritable",
            value=stats["storage"]["failures"],
        )
        for name, value in stats["totals"].items():
            yield CounterMetricFamily(
                f"{self._prefix}_{name}", f"Total {name.replace('_', ' ')}", value=value
            )
