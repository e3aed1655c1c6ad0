"""Writing sessions to their dump files: stale dumps, the drain's and the compaction's snapshots.

Each session is snapshotted on the event loop (under its lock, or as a copy while it stays live), then
serialized and written atomically in a worker thread, a few at a time.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from ..session import Session
from ..stats import Counters
from .dumps import write_session_dump

log = logging.getLogger("rolloutfleet.proxy.cleanup")


class SessionFiles:
    """Writes sessions to an area of the dump directory with bounded parallelism, off the event loop."""

    def __init__(self, dump_dir: Path, concurrency: int, counters: Counters):
        self._dump_dir = dump_dir
        self._concurrency = concurrency
        self._counters = counters

    async def write(
        self, sessions: list[Session], area: str, reason: str, copy: bool = False
    ) -> tuple[list[Session], list[Session]]:
        """The sessions written, and those whose write failed. `copy`: snapshot sessions that stay live
        (compaction): a copy made on the loop, no lock."""
        written: list[Session] = []
        failed: list[Session] = []
        # A few workers share one iterator: thousands of stale sessions never become thousands of
        # tasks started in one loop iteration (that alone stalled the loop ~30 ms for 5k sessions).
        pending = iter(sessions)

        async def worker() -> None:
            for session in pending:
                ok = await self._write_one(session, area, reason, copy)
                (written if ok else failed).append(session)

        await asyncio.gather(*(worker() for _ in range(min(self._concurrency, len(sessions)))))
        return written, failed

    async def _write_one(self, session: Session, area: str, reason: str, copy: bool) -> bool:
        if copy:
            record = session.copied_record()
        else:
            async with session.lock:  # a detached session has no turn, but never snapshot mid-mutation
                record = session.to_record()
        try:
            await asyncio.to_thread(write_session_dump, self._dump_dir, area, record, reason)
        except Exception as exc:  # any failure keeps the session; it is retried
            self._counters.dump_failures += 1
            log.error(
                "dump of session %s to %s failed: %s: %s", session.session_id, area, type(exc).__name__, exc
            )
            return False
        return True
