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
from .dumps import LIVE_AREA, check_writable, list_live_dumps, load_session_file, quarantine
from .errors import ProxyError
from .export_buffer import ExportBuffer
from .exports import ExportService
from .generation import GenerationControl
from .heap import HeapTrimmer
from .looplag import LoopLagMonitor
from .replies import ReplyBuilder
from .session import Session
from .settings import ProxySettings
from .state_file import ProxyState, StateFormatError, StateKeeper, read_state, state_path
from .stats import AdmissionCounters, Counters, Gauges, build_stats
from .store import SessionStore
from .turns import TurnService
from .upstream import SGLangClient

log = logging.getLogger("rolloutfleet.proxy")

DRAIN_WRITE_ATTEMPTS = 3


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
        self.exports = ExportService(
            self.store,
            ExportBuffer(settings.tombstone_capacity),
            self.generation,
            self.counters,
            settings.dump_dir,
            settings.export_ttl_s,
            drop_without_dump=settings.allow_dropping_sessions,
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
        )
        self.tokenizer = tokenizer
        self.upstream: SGLangClient | None = None
        self.turns: TurnService | None = None
        self.started = False
        self.drain_ok: bool | None = None
        self._tasks: list[asyncio.Task] = []
        self._drain_task: asyncio.Task | None = None
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
        """Bring back the sessions a predecessor drained into the live area."""
        dump_dir = self.settings.dump_dir
        if dump_dir is None:
            return
        for path in await asyncio.to_thread(list_live_dumps, dump_dir):
            try:
                record = await asyncio.to_thread(load_session_file, path)
            except Exception as exc:  # whatever is wrong with one file must not stop the others or the start
                self.counters.restore_failures += 1
                target = await asyncio.to_thread(quarantine, path, dump_dir)
                log.error("cannot restore %s (%s); kept as %s", path, exc, target)
                continue
            try:
                self.store.add(Session.from_record(record))
            except ProxyError as exc:
                self.counters.restore_failures += 1
                log.error("cannot restore %s: %s; the file is kept", path, exc.message)
                continue
            await asyncio.to_thread(path.unlink)
            self.counters.sessions_restored += 1

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

    async def _write_drained(self, sessions: list[Session]) -> bool:
        if self.writer.dump_dir is None:
            for session in sessions:
                self.store.forget(session, "shutdown: dropped (no dump directory)")
            self.counters.sessions_dropped += len(sessions)
            return True
        pending = sessions
        for attempt in range(DRAIN_WRITE_ATTEMPTS):
            outcome = await self.writer.write(pending, LIVE_AREA, "drain")
            for session in outcome.written:
                # Not remembered as ended: the session lives on in the next process.
                self.store.forget(session, "written to the live area for the next process", remember=False)
            self.counters.sessions_drained += len(outcome.written)
            pending = outcome.failed
            if not pending:
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
