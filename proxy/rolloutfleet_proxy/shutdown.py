"""The shutdown writer: on SIGTERM (or a stop without one) refuse new work, let the turns in flight
finish, then write every live session, the unacknowledged export batches and the state file for the
successor, and retire the journal those snapshots made redundant."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from .cleanup import SessionWriter
from .dumps import LIVE_AREA, remove_other_dumps
from .exports import ExportService
from .generation import GenerationControl
from .journal import Journal
from .lifecycle import InFlightTurns, Lifecycle
from .session import Session
from .stats import Counters
from .store import SessionStore

log = logging.getLogger("rolloutfleet.proxy")

DRAIN_WRITE_ATTEMPTS = 3


class ShutdownWriter:
    def __init__(
        self,
        lifecycle: Lifecycle,
        in_flight: InFlightTurns,
        generation: GenerationControl,
        store: SessionStore,
        exports: ExportService,
        writer: SessionWriter,
        journal: Journal | None,
        counters: Counters,
        background_locks: tuple[asyncio.Lock, ...],
        save_state: Callable[[], Awaitable[bool]],
        grace_s: float,
    ):
        self._lifecycle = lifecycle
        self._in_flight = in_flight
        self._generation = generation
        self._store = store
        self._exports = exports
        self._writer = writer
        self._journal = journal
        self._counters = counters
        self._background_locks = background_locks  # held while writing: no background run meanwhile
        self._save_state = save_state
        self._grace_s = grace_s
        self._task: asyncio.Task | None = None

    def request(self) -> asyncio.Task:
        """Start the drain, once; the same task for every later request."""
        if self._task is None:
            self._task = asyncio.create_task(self.drain(), name="drain")
        return self._task

    async def drain(self) -> bool:
        """Refuse new work, let in-flight turns finish, write every live session to the live area."""
        self._lifecycle.begin_drain()
        self._generation.close()  # turns held by a pause give up now: they continue on the successor
        log.info("draining: refusing new sessions and turns")
        await self._lifecycle.wait_started()  # a SIGTERM during start-up drains what the restore brought back
        try:
            await asyncio.wait_for(self._in_flight.wait_idle(), self._grace_s)
        except TimeoutError:
            log.warning("drain grace period over; cancelling %d in-flight turns", self._in_flight.generating)
            self._in_flight.cancel_all()
            await self._in_flight.wait_idle()
        await self._exports.quiesce()
        async with contextlib.AsyncExitStack() as held:
            for lock in self._background_locks:
                await held.enter_async_context(lock)
            async with self._store.lock:
                sessions = self._store.detach_all()
            ok = await self._write_drained(sessions)
            ok = await self._exports.write_for_shutdown() and ok
        if not await self._save_state():
            log.error("the state file could not be written; the successor starts at model version 0")
        self._lifecycle.drain_finished(ok)
        fields = {
            "ok": ok,
            "drained": self._counters.sessions_drained,
            "drained_batches": self._counters.batches_drained,
        }
        log.info("drain finished", extra={"fields": fields})
        return ok

    async def _retire_journal(self, drained: set[str]) -> None:
        """Every session is in its live/ snapshot now: the journal and older snapshots are redundant.
        A failure here loses nothing (the next start replays the journal over the snapshots)."""
        dump_dir = self._writer.dump_dir
        if self._journal is None or dump_dir is None:
            return
        try:
            await self._journal.close()
            await asyncio.to_thread(remove_other_dumps, dump_dir, LIVE_AREA, drained)
            await self._journal.retire(self._journal.segment_seq + 1)
        except OSError as exc:
            log.warning("drain: the journal could not be retired (%s); the next start replays it", exc)

    async def _write_drained(self, sessions: list[Session]) -> bool:
        if self._writer.dump_dir is None:
            for session in sessions:
                self._store.forget(session, "shutdown: dropped (no dump directory)")
            self._counters.sessions_dropped += len(sessions)
            return True
        pending = sessions
        drained: set[str] = set()
        for attempt in range(DRAIN_WRITE_ATTEMPTS):
            outcome = await self._writer.write(pending, LIVE_AREA, "drain")
            for session in outcome.written:
                # Not remembered as ended: the session lives on in the next process.
                self._store.forget(session, "written to the live area for the next process", remember=False)
                drained.add(session.session_id)
            self._counters.sessions_drained += len(outcome.written)
            pending = outcome.failed
            if not pending:
                await self._retire_journal(drained)
                return True
            await asyncio.sleep(0.2 * (attempt + 1))
        for session in pending:
            self._store.reattach(session)
        log.critical(
            "drain could not write %d sessions: %s",
            len(pending),
            ", ".join(s.session_id for s in pending[:20]),
        )
        return False
