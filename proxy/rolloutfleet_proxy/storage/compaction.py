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
from collections.abc import Callable
from pathlib import Path

from ..session import Session
from ..stats import Counters
from .dumps import LIVE_AREA, remove_other_dumps
from .journal import Journal
from .routing_store import RoutingStore, record_key
from .session_files import SessionFiles

log = logging.getLogger("rolloutfleet.proxy.compaction")


class Compactor:
    def __init__(
        self,
        held_sessions: Callable[[], list[Session]],
        files: SessionFiles,
        journal: Journal,
        dump_dir: Path,
        counters: Counters,
        routing: RoutingStore,
    ):
        self._routing = routing
        self._held_sessions = held_sessions  # every session held, live or detached (being written)
        self._files = files
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
        sessions = self._held_sessions()
        _, failed = await self._files.write(sessions, LIVE_AREA, "snapshot", copy=True)
        if failed:
            self._counters.compaction_failures += 1
            log.error("compaction: %d snapshots could not be written; the journal is kept", len(failed))
            return False
        try:  # the routing replay rows the old segments hold are in the sessions' files: synced first
            await asyncio.to_thread(self._routing.sync, [record_key(s) for s in sessions])
        except OSError as exc:
            self._counters.compaction_failures += 1
            log.error("compaction: routing files could not be synced (%s); the journal is kept", exc)
            return False
        held = {s.session_id for s in self._held_sessions()} | {s.session_id for s in sessions}
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
