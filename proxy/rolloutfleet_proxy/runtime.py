"""The proxy's parts wired together, and its life: restore on start, cleanup, heartbeat, drain on stop."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from typing import Any

from .chat_tokens import TurnTokenizer
from .cleanup import SessionWriter, StaleSessionCleaner
from .dumps import LIVE_AREA, list_live_dumps, load_session_file, quarantine
from .errors import ProxyError
from .heap import HeapTrimmer
from .looplag import LoopLagMonitor
from .session import Session
from .settings import ProxySettings
from .stats import Counters, Gauges, build_stats
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
        self.store = SessionStore(settings.tombstone_capacity)
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
        self._started_event = asyncio.Event()

    def stats(self) -> dict[str, Any]:
        stats = build_stats(
            self.counters, self.gauges, len(self.store), self.store.detached_count, self.store.tokens_held
        )
        stats["loop_lag_max_seconds"] = round(self.loop_lag.max_s, 6)
        stats["loop_lag_recent_max_seconds"] = round(self.loop_lag.recent_max(time.monotonic()), 6)
        return stats

    async def start(self) -> None:
        if self.tokenizer is None:
            self.tokenizer = await asyncio.to_thread(TurnTokenizer.from_path, self.settings.tokenizer_path)
        self.upstream = SGLangClient(
            self.settings.upstream_url,
            self.settings.upstream_timeout_s,
            self.settings.upstream_max_connections,
        )
        self.turns = TurnService(self.store, self.tokenizer, self.upstream, self.counters, self.gauges)
        await self.restore()
        if self.settings.cleanup_enabled:
            self._tasks.append(asyncio.create_task(self._cleanup_loop(), name="stale-session-cleanup"))
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
                    "upstream": self.settings.upstream_url,
                }
            },
        )

    async def stop(self) -> None:
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

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval_s)
            try:
                log.info("stats", extra={"fields": self.stats()})
            except Exception:
                log.exception("stats heartbeat failed")

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
        async with self._cycle_lock:
            async with self.store.lock:
                sessions = self.store.detach_all()
            ok = await self._write_drained(sessions)
        self.drain_ok = ok
        log.info("drain finished", extra={"fields": {"ok": ok, "drained": self.counters.sessions_drained}})
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
