"""The proxy's parts wired together, and their life: restore on start, the background tasks, the
drain on stop."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from typing import Any

from .admission import AdmissionLimits
from .chat_tokens import TurnTokenizer
from .cleanup import SessionWriter, StaleSessionCleaner
from .compaction import Compactor
from .dumps import check_writable, probe_writable
from .export_buffer import ExportBuffer
from .exports import ExportService
from .generation import GenerationControl
from .heap import HeapTrimmer
from .journal import Journal, StorageHealth, journal_dir
from .lifecycle import InFlightTurns, Lifecycle
from .looplag import LoopLagMonitor
from .model_version import ModelVersions
from .periodic import PeriodicTask
from .replies import ReplyBuilder
from .restore import restore_sessions, restore_state
from .runtime_stats import runtime_stats
from .session_log import SessionLog
from .settings import ProxySettings
from .shutdown import ShutdownWriter
from .state_file import FLUSH_INTERVAL_S, StateKeeper
from .stats import AdmissionCounters, Counters, Gauges
from .store import SessionStore
from .turns import TurnLimits, TurnService
from .upstream import SGLangClient

log = logging.getLogger("rolloutfleet.proxy")

COMPACTION_CHECK_INTERVAL_S = 1.0


class ProxyRuntime:
    def __init__(self, settings: ProxySettings, tokenizer: TurnTokenizer | None = None):
        self.settings = settings
        self.lifecycle = Lifecycle()
        self.in_flight = InFlightTurns(self.lifecycle)
        self.counters = Counters()
        self.gauges = Gauges()
        self.admission = AdmissionCounters()
        self.limits = AdmissionLimits(
            settings.max_staleness, settings.staleness_batch_share, settings.max_concurrent_sessions
        )
        self.store = SessionStore(settings.tombstone_capacity, self.admission)
        self.generation = GenerationControl(settings.paused_turn_timeout_s)
        self.storage = StorageHealth()
        self.journal = (
            Journal(
                journal_dir(settings.dump_dir),
                self.storage,
                settings.durability,
                settings.journal_flush_interval_s,
            )
            if settings.dump_dir
            else None
        )
        self.log = SessionLog(self.journal, self.storage)
        self.exports = ExportService(
            self.store,
            ExportBuffer(settings.tombstone_capacity),
            self.generation,
            self.counters,
            settings.dump_dir,
            settings.export_ttl_s,
            drop_without_dump=settings.allow_dropping_sessions,
            session_log=self.log,
        )
        self.versions = ModelVersions(
            self.generation, self.admission, self.limits, self.store, self.exports.buffer, self.save_state
        )
        self.state = (
            StateKeeper(settings.dump_dir, self.versions.persisted_state, self.counters)
            if settings.dump_dir
            else None
        )
        self.trimmer = HeapTrimmer(enabled=settings.trim_heap)
        self.gauges.trim_available = self.trimmer.available
        self.writer = SessionWriter(settings.dump_dir, settings.dump_write_concurrency, self.counters)
        self.loop_lag = LoopLagMonitor()
        self.cleaner = StaleSessionCleaner(
            self.store,
            self.writer,
            self.trimmer,
            self.counters,
            self.gauges,
            timeout_s=settings.stale_session_timeout_s,
            interval_s=settings.cleanup_interval_s,
            drop_without_dump=settings.allow_dropping_sessions,
            session_log=self.log,
        )
        self.compactor = (
            Compactor(self.store, self.writer, self.journal, settings.dump_dir, self.counters)
            if self.journal is not None and settings.dump_dir is not None
            else None
        )
        self.tokenizer = tokenizer
        self.upstream: SGLangClient | None = None
        self.turns: TurnService | None = None
        # A cleanup cycle or compaction writes sessions, an expiry sweep export batches: the drain
        # takes both locks, so none of them runs during or after it.
        self._cycle_lock = asyncio.Lock()
        self._sweep_lock = asyncio.Lock()
        self.background = self._background_tasks()
        self.shutdown = ShutdownWriter(
            self.lifecycle,
            self.in_flight,
            self.generation,
            self.store,
            self.exports,
            self.writer,
            self.journal,
            self.counters,
            (self._cycle_lock, self._sweep_lock),
            self.save_state,
            settings.drain_grace_s,
        )
        self._loop_lag_task: asyncio.Task | None = None
        self._trim_task: asyncio.Task | None = None

    def _background_tasks(self) -> dict[str, PeriodicTask]:
        settings, counters = self.settings, self.counters

        def draining() -> bool:
            return self.lifecycle.draining

        def count_cleanup_error() -> None:
            counters.cleanup_errors += 1

        def count_compaction_failure() -> None:
            counters.compaction_failures += 1

        tasks = [
            PeriodicTask(
                "export-expiry",
                lambda: self.exports.sweep_interval_s,
                lambda: self.exports.sweep(),
                lock=self._sweep_lock,
                finished=draining,
            ),
            PeriodicTask(
                "stats-heartbeat",
                settings.heartbeat_interval_s,
                lambda: self._log_stats(),
            ),
        ]
        if settings.cleanup_enabled:
            tasks.append(
                PeriodicTask(
                    "stale-session-cleanup",
                    lambda: self.cleaner.interval_s,
                    lambda: self.cleaner.run_once(),
                    lock=self._cycle_lock,
                    finished=draining,
                    on_failure=count_cleanup_error,
                )
            )
        if self.state is not None:
            # Counters change with every session, too often for a write each.
            tasks.append(PeriodicTask("state-flush", FLUSH_INTERVAL_S, self.state.flush_if_changed))
        if self.journal is not None and self.compactor is not None:
            journal, compactor = self.journal, self.compactor
            tasks.append(
                PeriodicTask(
                    "storage-check",  # honest readiness even when no request writes
                    self._storage_check_interval,
                    self.check_storage,
                )
            )
            tasks.append(
                PeriodicTask(
                    "journal-compaction",
                    COMPACTION_CHECK_INTERVAL_S,
                    compactor.compact,
                    lock=self._cycle_lock,  # not during a cleanup cycle's writes
                    due=lambda: journal.total_bytes >= settings.journal_compact_bytes and self.storage.ok,
                    finished=draining,
                    on_failure=count_compaction_failure,
                )
            )
        return {task.name: task for task in tasks}

    async def _log_stats(self) -> None:
        log.info("stats", extra={"fields": self.stats()})

    # --- state file, stats ---------------------------------------------------------------------

    async def save_state(self) -> bool:
        """Write the state file now (True when written; also True without a dump directory)."""
        return await self.state.save() if self.state is not None else True

    def stats(self) -> dict[str, Any]:
        return runtime_stats(self)

    # --- life ---------------------------------------------------------------------------------

    async def start(self) -> None:
        dump_dir = self.settings.dump_dir
        if dump_dir is not None:
            await asyncio.to_thread(check_writable, dump_dir)
        if self.tokenizer is None:
            self.tokenizer = await asyncio.to_thread(
                TurnTokenizer.from_path,
                self.settings.tokenizer_path,
                tool_results=self.settings.tool_call_parser is not None,
                default_kwargs=self.settings.chat_template_kwargs,
            )
        self.upstream = SGLangClient(
            self.settings.upstream_url,
            self.settings.upstream_timeout_s,
            self.settings.upstream_max_connections,
        )
        self.turns = TurnService(
            self.store,
            self.tokenizer,
            self.upstream,
            self.counters,
            self.in_flight,
            self.generation,
            ReplyBuilder(self.tokenizer, self.settings.tool_call_parser, self.settings.reasoning_parser),
            self.settings.engine_logprobs,
            self.log,
            TurnLimits(
                self.settings.max_new_message_bytes,
                self.settings.offload_templating_bytes,
                self.settings.max_branches_per_session,
                self.settings.abort_ride_through_s,
            ),
            self.request_heap_trim,
        )
        if dump_dir is not None:
            await restore_state(dump_dir, self.generation, self.admission, self.counters)
            assert self.journal is not None
            await restore_sessions(
                dump_dir,
                self.settings.tombstone_capacity,
                self.store,
                self.journal,
                self.counters,
                self.trimmer,
            )
        await self.exports.restore()
        self.versions.rebase_after_restore()
        for task in self.background.values():
            task.start()
        self._loop_lag_task = asyncio.create_task(self.loop_lag.run(), name="loop-lag-monitor")
        # Long-lived start-up objects (modules, tokenizer) leave the collector's view, so collections
        # that requests trigger scan only what requests made. Not gc.collect(): that stalls the loop.
        gc.freeze()
        self.lifecycle.started()
        log.info(
            "proxy started",
            extra={
                "fields": {
                    "restored": self.counters.sessions_restored,
                    "restored_batches": self.counters.batches_restored,
                    "model_version": self.generation.model_version,
                    "paused": self.generation.paused,
                    "upstream": self.settings.upstream_url,
                }
            },
        )

    async def stop(self) -> None:
        # Stopped without a SIGTERM drain (an embedding server, the tests): drain now, so sessions,
        # export batches and the state are written here too.
        if self.lifecycle.start_finished:
            await self.request_drain()
        for task in self.background.values():
            await task.stop()
        if self._loop_lag_task is not None:
            self._loop_lag_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_lag_task
        if self.upstream is not None:
            await self.upstream.aclose()
        if self.journal is not None:
            await self.journal.close()

    def request_drain(self) -> asyncio.Task:
        return self.shutdown.request()

    def request_heap_trim(self) -> None:
        """Trim the heap soon, in a worker thread, at most one trim at a time (after a large turn)."""
        if not self.trimmer.available or (self._trim_task is not None and not self._trim_task.done()):
            return

        async def trim() -> None:
            if await asyncio.to_thread(self.trimmer.trim):
                self.counters.heap_trims += 1

        self._trim_task = asyncio.create_task(trim(), name="heap-trim")

    def _storage_check_interval(self) -> float:
        interval = self.settings.storage_check_interval_s
        return interval if self.storage.ok else min(interval, 1.0)

    async def check_storage(self) -> bool:
        """Probe the dump volume (write + fsync)."""
        assert self.settings.dump_dir is not None
        try:
            await asyncio.to_thread(probe_writable, self.settings.dump_dir)
        except OSError as exc:
            self.storage.fail(f"{type(exc).__name__}: {exc}")
            return False
        self.storage.recover()
        return True
