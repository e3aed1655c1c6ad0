"""The proxy's parts wired together, and its life: restore on start, cleanup, export expiry,
heartbeat, drain on stop."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from typing import Any

from .admission import (
    AdmissionLimits,
    accepted_after_version_change,
    admission_capacity,
    is_training_step,
    rebased_accepted,
)
from .chat_tokens import TurnTokenizer
from .cleanup import SessionWriter, StaleSessionCleaner
from .compaction import Compactor
from .dumps import LIVE_AREA, check_writable, probe_writable, quarantine, remove_other_dumps
from .export_buffer import ExportBuffer
from .exports import ExportService
from .generation import GenerationControl
from .heap import HeapTrimmer
from .journal import Journal, StorageHealth, journal_dir
from .looplag import LoopLagMonitor
from .recovery import recover
from .replies import ReplyBuilder
from .session import Session
from .session_log import SessionLog
from .settings import ProxySettings
from .state_file import ProxyState, StateFormatError, StateKeeper, read_state, state_path
from .stats import AdmissionCounters, Counters, Gauges, build_stats
from .store import SessionStore
from .turns import TurnLimits, TurnService
from .upstream import SGLangClient

log = logging.getLogger("rolloutfleet.proxy")

DRAIN_WRITE_ATTEMPTS = 3
COMPACTION_CHECK_INTERVAL_S = 1.0


class ProxyRuntime:
    def __init__(self, settings: ProxySettings, tokenizer: TurnTokenizer | None = None):
        self.settings = settings
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
        self.state = (
            StateKeeper(settings.dump_dir, self.persisted_state, self.counters) if settings.dump_dir else None
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
        self.started = False
        self.drain_ok: bool | None = None
        self._tasks: list[asyncio.Task] = []
        self._drain_task: asyncio.Task | None = None
        self._trim_task: asyncio.Task | None = None
        self._cycle_lock = asyncio.Lock()
        self._sweep_lock = asyncio.Lock()
        self._started_event = asyncio.Event()

    # --- model version, admission -------------------------------------------------------------

    def unconsumed_trajectories(self) -> int:
        """Trajectories produced and not yet consumed by the trainer: ready, or exported and not acked."""
        return self.store.ready_count + self.exports.buffer.trajectories

    def admission_capacity(self) -> int | None:
        return admission_capacity(
            self.limits, self.generation.model_version, self.admission.accepted, self.store.running
        )

    def persisted_state(self) -> ProxyState:
        return ProxyState(
            model_version=self.generation.model_version,
            paused=self.generation.paused,
            enqueued=self.admission.enqueued,
            accepted=self.admission.accepted,
            rejected=self.admission.rejected,
            refused=self.admission.refused,
        )

    async def save_state(self) -> bool:
        """Write the state file now (True when written; also True without a dump directory)."""
        return await self.state.save() if self.state is not None else True

    async def set_model_version(self, version: int) -> dict[str, Any]:
        old = self.generation.model_version
        self.admission.accepted = accepted_after_version_change(
            self.admission.accepted, old, version, self.limits.batch_share, self.unconsumed_trajectories()
        )
        self.generation.model_version = version
        persisted = await self.save_state()
        return {
            "previous_model_version": old,
            "rebased": not is_training_step(old, version),
            "persisted": persisted,
        }

    def generation_state(self) -> dict[str, Any]:
        return {
            "model_version": self.generation.model_version,
            "paused": self.generation.paused,
            "generating_turns": self.generation.generating,
            "paused_turns": self.generation.waiting,
        }

    def admission_stats(self) -> dict[str, Any]:
        return {
            "enabled": self.limits.enabled,
            "max_staleness": self.limits.max_staleness,
            "batch_share": self.limits.batch_share,
            "max_concurrent_sessions": self.limits.max_concurrent,
            "capacity": self.admission_capacity(),
            "enqueued": self.admission.enqueued,
            "running": self.store.running,
            "accepted": self.admission.accepted,
            "rejected": self.admission.rejected,
            "refused": self.admission.refused,
        }

    def stats(self) -> dict[str, Any]:
        stats = build_stats(
            self.counters, self.gauges, len(self.store), self.store.detached_count, self.store.tokens_held
        )
        stats["loop_lag_max_seconds"] = round(self.loop_lag.max_s, 6)
        stats["loop_lag_recent_max_seconds"] = round(self.loop_lag.recent_max(time.monotonic()), 6)
        buffer = self.exports.buffer
        stats["model_version"] = self.generation.model_version
        stats["generation_paused"] = self.generation.paused
        stats["paused_turns"] = self.generation.waiting
        stats["ready_trajectories"] = self.store.ready_count
        stats["export_batches"] = len(buffer)
        stats["export_trajectories"] = buffer.trajectories
        stats["export_bytes"] = buffer.bytes
        stats["admission"] = self.admission_stats()
        stats["storage_writable"] = self.storage.ok
        stats["storage"] = {
            "writable": self.storage.ok,
            "reason": self.storage.reason,
            "since": self.storage.since,
            "failures": self.storage.failures,
            "durability": self.settings.durability if self.journal is not None else "none",
        }
        journal = self.journal.stats if self.journal is not None else None
        stats["journal_bytes"] = self.journal.total_bytes if self.journal is not None else 0
        stats["journal"] = {
            "records": journal.records if journal else 0,
            "syncs": journal.syncs if journal else 0,
            "bytes_written": journal.bytes_written if journal else 0,
            "write_failures": journal.write_failures if journal else 0,
            "segments": len(journal.sizes) if journal else 0,
            "segments_retired": journal.segments_retired if journal else 0,
            "commit_wait_mean_ms": round(1000 * journal.commit_wait_s / journal.commits, 3)
            if journal and journal.commits
            else 0.0,
            "last_compaction_seconds": self.compactor.last_seconds if self.compactor else 0.0,
            "compacting": bool(self.compactor and self.compactor.running),
        }
        stats["sessions_lost"] = self.store.lost_count
        return stats

    async def start(self) -> None:
        if self.settings.dump_dir is not None:
            await asyncio.to_thread(check_writable, self.settings.dump_dir)
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
            self.gauges,
            self.generation,
            ReplyBuilder(self.tokenizer, self.settings.tool_call_parser, self.settings.reasoning_parser),
            self.settings.engine_logprobs,
            self.log,
            TurnLimits(self.settings.max_new_message_bytes, self.settings.offload_templating_bytes),
            self.request_heap_trim,
        )
        await self.restore_state()
        await self.restore()
        await self.exports.restore()
        # Counting restarts here: anchor `accepted` to the recovered version (lesson 12).
        self.admission.accepted = rebased_accepted(
            self.generation.model_version, self.limits.batch_share, self.unconsumed_trajectories()
        )
        if self.settings.cleanup_enabled:
            self._tasks.append(asyncio.create_task(self._cleanup_loop(), name="stale-session-cleanup"))
        self._tasks.append(asyncio.create_task(self._export_sweep_loop(), name="export-expiry"))
        if self.state is not None:
            self._tasks.append(asyncio.create_task(self.state.run(), name="state-flush"))
        if self.journal is not None:
            self._tasks.append(asyncio.create_task(self._storage_check_loop(), name="storage-check"))
            self._tasks.append(asyncio.create_task(self._compaction_loop(), name="journal-compaction"))
        self._tasks.append(asyncio.create_task(self._heartbeat(), name="stats-heartbeat"))
        self._tasks.append(asyncio.create_task(self.loop_lag.run(), name="loop-lag-monitor"))
        # Long-lived start-up objects (modules, tokenizer) leave the collector's view, so collections
        # that requests trigger scan only what requests made. Not gc.collect(): that stalls the loop.
        gc.freeze()
        self.started = True
        self._started_event.set()
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
        if self.started:
            await self.request_drain()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.upstream is not None:
            await self.upstream.aclose()
        if self.journal is not None:
            await self.journal.close()

    async def _cleanup_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cleaner.interval_s)
            async with self._cycle_lock:  # the drain takes this lock: no cycle runs during or after it
                if self.gauges.draining:
                    return
                try:
                    await self.cleaner.run_once()
                except Exception:
                    self.counters.cleanup_errors += 1
                    log.exception("stale-session cleanup cycle failed; the next cycle retries")

    def request_heap_trim(self) -> None:
        """Trim the heap soon, in a worker thread, at most one trim at a time (after a large turn)."""
        if not self.trimmer.available or (self._trim_task is not None and not self._trim_task.done()):
            return

        async def trim() -> None:
            if await asyncio.to_thread(self.trimmer.trim):
                self.counters.heap_trims += 1

        self._trim_task = asyncio.create_task(trim(), name="heap-trim")

    async def _storage_check_loop(self) -> None:
        """Probe the dump volume (write + fsync): honest readiness even when no request writes."""
        dump_dir = self.settings.dump_dir
        assert dump_dir is not None
        while True:
            interval = self.settings.storage_check_interval_s
            await asyncio.sleep(interval if self.storage.ok else min(interval, 1.0))
            await self.check_storage()

    async def check_storage(self) -> bool:
        assert self.settings.dump_dir is not None
        try:
            await asyncio.to_thread(probe_writable, self.settings.dump_dir)
        except OSError as exc:
            self.storage.fail(f"{type(exc).__name__}: {exc}")
            return False
        self.storage.recover()
        return True

    async def _compaction_loop(self) -> None:
        assert self.journal is not None and self.compactor is not None
        while True:
            await asyncio.sleep(COMPACTION_CHECK_INTERVAL_S)
            if self.journal.total_bytes < self.settings.journal_compact_bytes or not self.storage.ok:
                continue
            async with self._cycle_lock:  # not during a cleanup cycle's writes, nor during or after the drain
                if self.gauges.draining:
                    return
                try:
                    await self.compactor.compact()
                except Exception:
                    self.counters.compaction_failures += 1
                    log.exception("journal compaction failed; the journal is kept and the next check retries")

    async def _export_sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.exports.sweep_interval_s)
            async with self._sweep_lock:  # the drain takes this lock too
                if self.gauges.draining:
                    return
                try:
                    await self.exports.sweep()
                except Exception:
                    log.exception("export expiry sweep failed; the next sweep retries")

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval_s)
            try:
                log.info("stats", extra={"fields": self.stats()})
            except Exception:
                log.exception("stats heartbeat failed")

    async def restore_state(self) -> None:
        """Recover the model version, the pause and the counters a predecessor saved."""
        dump_dir = self.settings.dump_dir
        if dump_dir is None:
            return
        try:
            state = await asyncio.to_thread(read_state, dump_dir)
        except (OSError, StateFormatError) as exc:
            # Starting at version 0 is safe: the trainer's next version is then a jump, and rebases.
            self.counters.restore_failures += 1
            target = await asyncio.to_thread(quarantine, state_path(dump_dir), dump_dir)
            log.error("cannot read the state file (%s); kept as %s; starting at version 0", exc, target)
            return
        if state is None:
            return
        self.generation.model_version = state.model_version
        if state.paused:
            self.generation.pause()
        self.admission.enqueued = state.enqueued
        self.admission.accepted = state.accepted  # rebased once the sessions are restored
        self.admission.rejected = state.rejected
        self.admission.refused = state.refused

    async def restore(self) -> None:
        """Bring back every session a predecessor held: its snapshots in `live/`, then its journal
        replayed over them (after a SIGKILL as after a drain). Nothing read is deleted here."""
        dump_dir = self.settings.dump_dir
        if dump_dir is None:
            return
        log.info("restoring from %s", dump_dir)
        recovered = await asyncio.to_thread(recover, dump_dir, self.settings.tombstone_capacity)
        for session in recovered.sessions.values():
            self.store.add(session)
        for session_id, why in recovered.lost.items():
            self.store.mark_lost(session_id, why)
        self.counters.sessions_restored += len(recovered.sessions)
        self.counters.sessions_lost += len(recovered.lost)
        self.counters.restore_failures += len(recovered.quarantined)
        assert self.journal is not None
        await self.journal.open(recovered.last_seq)
        log.info(
            "restored",
            extra={
                "fields": {
                    "sessions": len(recovered.sessions),
                    "snapshots": recovered.snapshots,
                    "journal_segments": recovered.segments,
                    "journal_records": recovered.records,
                    "lost": len(recovered.lost),
                    "quarantined": recovered.quarantined,
                    "seconds": round(recovered.seconds, 3),
                }
            },
        )
        del recovered
        if self.trimmer.available:  # the replay grew arrays step by step: give the slack back
            await asyncio.to_thread(self.trimmer.trim)

    def request_drain(self) -> asyncio.Task:
        if self._drain_task is None:
            self._drain_task = asyncio.create_task(self.drain(), name="drain")
        return self._drain_task

    async def drain(self) -> bool:
        """Refuse new work, let in-flight turns finish, write every live session to the live area."""
        self.gauges.draining = True
        self.generation.close()  # turns held by a pause give up now: they continue on the successor
        log.info("draining: refusing new sessions and turns")
        await self._started_event.wait()  # a SIGTERM during start-up drains what the restore brought back
        assert self.turns is not None
        try:
            await asyncio.wait_for(self.turns.turns_done.wait(), self.settings.drain_grace_s)
        except TimeoutError:
            log.warning("drain grace period over; cancelling %d in-flight turns", self.gauges.inflight_turns)
            for session in self.store:
                if session.in_flight is not None:
                    session.in_flight.cancel()
            await self.turns.turns_done.wait()
        await self.exports.quiesce()
        async with self._cycle_lock, self._sweep_lock:
            async with self.store.lock:
                sessions = self.store.detach_all()
            ok = await self._write_drained(sessions)
            ok = await self.exports.write_for_shutdown() and ok
        if not await self.save_state():
            log.error("the state file could not be written; the successor starts at model version 0")
        self.drain_ok = ok
        fields = {
            "ok": ok,
            "drained": self.counters.sessions_drained,
            "drained_batches": self.counters.batches_drained,
        }
        log.info("drain finished", extra={"fields": fields})
        return ok

    async def _retire_journal(self, drained: set[str]) -> None:
        """Every session is in its live/ snapshot now: the journal and older snapshots are redundant.
        A failure here loses nothing (the next start replays the journal over the snapshots)."""
        if self.journal is None or self.settings.dump_dir is None:
            return
        try:
            await self.journal.close()
            await asyncio.to_thread(remove_other_dumps, self.settings.dump_dir, LIVE_AREA, drained)
            await self.journal.retire(self.journal.segment_seq + 1)
        except OSError as exc:
            log.warning("drain: the journal could not be retired (%s); the next start replays it", exc)

    async def _write_drained(self, sessions: list[Session]) -> bool:
        if self.writer.dump_dir is None:
            for session in sessions:
                self.store.forget(session, "shutdown: dropped (no dump directory)")
            self.counters.sessions_dropped += len(sessions)
            return True
        pending = sessions
        drained: set[str] = set()
        for attempt in range(DRAIN_WRITE_ATTEMPTS):
            outcome = await self.writer.write(pending, LIVE_AREA, "drain")
            for session in outcome.written:
                # Not remembered as ended: the session lives on in the next process.
                self.store.forget(session, "written to the live area for the next process", remember=False)
                drained.add(session.session_id)
            self.counters.sessions_drained += len(outcome.written)
            pending = outcome.failed
            if not pending:
                await self._retire_journal(drained)
                return True
            await asyncio.sleep(0.2 * (attempt + 1))
        for session in pending:
            self.store.reattach(session)
        log.critical(
            "drain could not write %d sessions: %s",
            len(pending),
            ", ".join(s.session_id for s in pending[:20]),
        )
        return False
