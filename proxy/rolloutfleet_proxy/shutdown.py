"""The shutdown drain: on SIGTERM (or a stop without one) refuse new work, let the turns in flight
finish, then hand every live session, the unacknowledged export batches and the state to the storage
for the successor (which then retires the journal those snapshots made redundant)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from .exports import ExportService
from .generation import GenerationControl
from .lifecycle import InFlightTurns, Lifecycle
from .session import Session
from .stats import Counters
from .storage import Storage
from .store import SessionStore

log = logging.getLogger("rolloutfleet.proxy")

DRAIN_WRITE_ATTEMPTS = 3


class ShutdownDrain:
    def __init__(
        self,
        lifecycle: Lifecycle,
        in_flight: InFlightTurns,
        generation: GenerationControl,
        store: SessionStore,
        exports: ExportService,
        storage: Storage,
        counters: Counters,
        background_locks: tuple[asyncio.Lock, ...],
        grace_s: float,
    ):
        self._lifecycle = lifecycle
        self._in_flight = in_flight
        self._generation = generation
        self._store = store
        self._exports = exports
        self._storage = storage
        self._counters = counters
        self._background_locks = background_locks  # held while writing: no background run meanwhile
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
            self._exports.release_for_shutdown()
        if not await self._storage.save_state():
            log.error("the state file could not be written; the successor starts at model version 0")
        self._lifecycle.drain_finished(ok)
        fields = {
            "ok": ok,
            "drained": self._counters.sessions_drained,
            "drained_batches": self._counters.batches_drained,
        }
        log.info("drain finished", extra={"fields": fields})
        return ok

    async def _write_drained(self, sessions: list[Session]) -> bool:
        """Every session to the storage, each failed write tried again; True when none was left."""
        pending = sessions
        drained: set[str] = set()
        for attempt in range(DRAIN_WRITE_ATTEMPTS):
            written = await self._storage.write_drained(pending)
            departure = written.departure
            for session in written.done:
                # A session that lives on in the next process is not remembered as ended here.
                self._store.forget(session, departure.reason, remember=not departure.lives_on)
                drained.add(session.session_id)
            pending = written.failed
            if not pending:
                await self._storage.drained(drained)
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
