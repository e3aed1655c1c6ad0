"""Compacting the journal: snapshot every session held into `live/`, then retire the old segments.

Rotation first: records appended from then on go to a new segment. Every change before the rotation
is already applied in memory (changes are applied, then journaled, in one synchronous step), so a
snapshot taken any time after it holds them all; replaying the newer segment over it is a no-op for
what it already holds. Only when every snapshot is durable are the snapshots of sessions no longer
held removed, and the old segments deleted. A kill at any point leaves either the old segments or the
new snapshots (or both) to restore from.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from .cleanup import SessionWriter
from .dumps import LIVE_AREA, remove_other_dumps
from .journal import Journal
from .stats import Counters
from .store import SessionStore

log = logging.getLogger("rolloutfleet.proxy.compaction")


class Compactor:
    def __init__(
        self, store: SessionStore, writer: SessionWriter, journal: Journal, dump_dir: Path, counters: Counters
    ):
        self._store = store
        self._writer = writer
        self._journal = journal
        self._dump_dir = dump_dir
        self._counters = counters
        self.last_seconds = 0.0
        self.running = False

    async def compact(self) -> bool:
        """True when the old segments were retired; False leaves them (the next compaction retries)."""
        self.running = True
        try:
            return await self._compact()
        finally:
            self.running = False

    async def _compact(self) -> bool:
        started = time.monotonic()
        retire_upto = self._journal.rotate()
        sessions = self._store.all_sessions()
        outcome = await self._writer.write(sessions, LIVE_AREA, "snapshot", copy=True)
        if outcome.failed:
            self._counters.compaction_failures += 1
            log.error(
                "compaction: %d snapshots could not be written; the journal is kept", len(outcome.failed)
            )
            return False
        held = {s.session_id for s in self._store.all_sessions()} | {s.session_id for s in sessions}
        await asyncio.to_thread(remove_other_dumps, self._dump_dir, LIVE_AREA, held)
        retired = await self._journal.retire(retire_upto)
        self._counters.compactions += 1
        self.last_seconds = round(time.monotonic() - started, 6)
        log.info(
            "journal compacted: %d sessions snapshotted, %d segments retired in %.3fs",
            len(sessions),
            retired,
            self.last_seconds,
        )
        return True
