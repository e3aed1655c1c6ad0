"""Writing sessions out before they leave memory: stale-session cleanup and the shutdown drain's dump.

Order for every session that leaves: detach from the store (under the store lock), snapshot under
the session's own lock, serialize and write in a worker thread, then forget it, or put it back if
the write failed so nothing is lost and the next cycle retries.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from .dumps import STALE_AREA, write_session_dump
from .failures import Failure
from .heap import HeapTrimmer
from .session import Session
from .session_log import SessionLog
from .stats import Counters, Gauges
from .store import SessionStore

log = logging.getLogger("rolloutfleet.proxy.cleanup")
YIELD_EVERY = 256  # sessions handled between yields to the event loop in bulk steps


@dataclass
class WriteOutcome:
    written: list[Session]
    failed: list[Session]


class SessionWriter:
    """Dumps detached sessions to disk with bounded parallelism, off the event loop."""

    def __init__(self, dump_dir: Path | None, concurrency: int, counters: Counters):
        self.dump_dir = dump_dir
        self._concurrency = concurrency
        self._counters = counters

    async def write(
        self, sessions: list[Session], area: str, reason: str, copy: bool = False
    ) -> WriteOutcome:
        """`copy`: snapshot sessions that stay live (compaction): a copy made on the loop, no lock."""
        dump_dir = self.dump_dir
        if dump_dir is None:
            return WriteOutcome(written=[], failed=list(sessions))
        outcome = WriteOutcome(written=[], failed=[])
        # A few workers share one iterator: thousands of stale sessions never become thousands of
        # tasks started in one loop iteration (that alone stalled the loop ~30 ms for 5k sessions).
        pending = iter(sessions)

        async def worker() -> None:
            for session in pending:
                ok = await self._write_one(dump_dir, session, area, reason, copy)
                (outcome.written if ok else outcome.failed).append(session)

        await asyncio.gather(*(worker() for _ in range(min(self._concurrency, len(sessions)))))
        return outcome

    async def _write_one(self, dump_dir: Path, session: Session, area: str, reason: str, copy: bool) -> bool:
        if copy:
            record = session.copied_record()
        else:
            async with session.lock:  # a detached session has no turn, but never snapshot mid-mutation
                record = session.to_record()
        try:
            await asyncio.to_thread(write_session_dump, dump_dir, area, record, reason)
        except Exception as exc:  # any failure keeps the session; it is retried
            self._counters.dump_failures += 1
            log.error(
                "dump of session %s to %s failed: %s: %s", session.session_id, area, type(exc).__name__, exc
            )
            return False
        return True


class StaleSessionCleaner:
    def __init__(
        self,
        store: SessionStore,
        writer: SessionWriter,
        trimmer: HeapTrimmer,
        counters: Counters,
        gauges: Gauges,
        timeout_s: float,
        interval_s: float,
        drop_without_dump: bool,
        session_log: SessionLog | None = None,
    ):
        self._log = session_log
        self._store = store
        self._writer = writer
        self._trimmer = trimmer
        self._counters = counters
        self._gauges = gauges
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self._drop_without_dump = drop_without_dump
        self._departed_at_last_trim = 0

    def _journal_end(self, session: Session, reason: str):
        if self._log is None:
            return None
        try:
            return self._log.ended(session, reason)
        except Failure:
            return None  # storage unavailable: the session may come back after a restart (not lost)

    async def _commit_ends(self, pending: list) -> None:
        if self._log is None:
            return
        for item in pending:
            try:
                await self._log.commit(item)
            except Failure as exc:
                log.error("departures of stale sessions not journaled (%s); they may be restored again", exc)
                return

    async def run_once(self) -> int:
        """Dump and evict every stale session; returns how many left memory."""
        started = time.monotonic()
        async with self._store.lock:
            stale = self._store.detach_stale(time.monotonic(), self.timeout_s)
        evicted = 0
        if stale:
            if self._writer.dump_dir is None and self._drop_without_dump:
                for session in stale:
                    self._store.forget(session, "dropped after idling (no dump directory)")
                self._counters.sessions_dropped += len(stale)
                evicted = len(stale)
            else:
                outcome = await self._writer.write(stale, STALE_AREA, "stale")
                reason = "idle past the stale-session timeout; dumped to disk"
                pending = []
                async with self._store.lock:
                    for i, session in enumerate(outcome.written, 1):
                        self._store.forget(session, reason)
                        pending.append(self._journal_end(session, reason))
                        if i % YIELD_EVERY == 0:
                            await asyncio.sleep(0)  # let requests in between batches
                    for session in outcome.failed:
                        self._store.reattach(session)
                await self._commit_ends(pending)
                self._counters.sessions_dumped += len(outcome.written)
                self._counters.sessions_evicted += len(outcome.written)
                evicted = len(outcome.written)
            del stale
        # Trim when anything left memory since the last trim: stale dumps here, but also DELETEs and
        # export batches freed by an acknowledgement, an expiry or a drop.
        c = self._counters
        departed = (
            c.sessions_evicted
            + c.sessions_dropped
            + c.batches_acknowledged
            + c.batches_expired
            + c.batches_dropped
        )
        if departed != self._departed_at_last_trim and self._trimmer.available:
            self._departed_at_last_trim = departed
            if await asyncio.to_thread(self._trimmer.trim):
                self._counters.heap_trims += 1
        self._counters.cleanup_cycles += 1
        self._gauges.last_cleanup_seconds = round(time.monotonic() - started, 6)
        if evicted:
            log.info("cleanup evicted %d stale sessions in %.3fs", evicted, self._gauges.last_cleanup_seconds)
        return evicted
