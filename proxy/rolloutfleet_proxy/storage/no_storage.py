"""No dump directory (`allow_dropping_sessions`): nothing is kept beyond memory.

Journal calls record nothing, and what leaves memory is dropped: stale sessions, the sessions and
batches held at shutdown, batches never acknowledged within the TTL. Each drop is counted and said in
the 410 its id answers with. The storage is always writable.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from ..export_buffer import ExportBatch
from ..periodic import PeriodicTask
from ..session import RecordedTurn, Session
from ..stats import Counters
from .health import StorageHealth
from .images import ImageStore
from .interface import Departure, Pending, RestoredSessions, Storage, Written, storage_stats
from .journal import JournalStats
from .routing_store import RoutingMemory
from .state_file import ProxyState

STALE_DROPPED = Departure("dropped after idling (no dump directory)")
DRAIN_DROPPED = Departure("shutdown: dropped (no dump directory)")
BATCH_DRAIN_DROPPED = Departure("dropped at shutdown (no dump directory)")


class NoStorage(Storage):
    def __init__(self, counters: Counters):
        self.health = StorageHealth()
        self.images = ImageStore(None)  # held in memory: nothing outlives the process anyway
        self.routing = RoutingMemory()
        self._counters = counters

    # --- start and stop ---------------------------------------------------------------------------

    async def open(self) -> None:
        pass

    async def restore_state(self) -> ProxyState | None:
        return None

    async def restore_sessions(self) -> RestoredSessions:
        return RestoredSessions([], {})

    async def restore_batches(self, ttl_s: float) -> list[ExportBatch]:
        return []

    def background_tasks(self, writes: asyncio.Lock, finished: Callable[[], bool]) -> list[PeriodicTask]:
        return []

    async def close(self) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        return storage_stats(self.health, "none", JournalStats(), 0, 0.0, False)

    # --- the journal ------------------------------------------------------------------------------

    def require_writable(self, what: str) -> None:
        pass

    def created(self, session: Session) -> Pending:
        return None

    def turn(self, session: Session, turn_index: int, turn: RecordedTurn) -> Pending:
        return None

    def rewarded(self, session: Session, value: float, turn: int | None) -> Pending:
        return None

    def finished(self, session: Session) -> Pending:
        return None

    def ended(self, session: Session, reason: str) -> Pending:
        return None

    async def commit(self, pending: Pending) -> None:
        pass

    async def save_state(self) -> bool:
        return True

    # --- what leaves memory is dropped ------------------------------------------------------------

    async def write_stale(self, sessions: list[Session]) -> Written:
        self._counters.sessions_dropped += len(sessions)
        return Written(STALE_DROPPED, list(sessions), [])

    async def write_drained(self, sessions: list[Session]) -> Written:
        self._counters.sessions_dropped += len(sessions)
        return Written(DRAIN_DROPPED, list(sessions), [])

    async def drained(self, session_ids: set[str]) -> None:
        pass

    async def keep_batch(self, batch_id: str, data: bytes, sessions: list[Session], reason: str) -> None:
        pass

    async def batch_acknowledged(self, batch_id: str) -> None:
        pass

    async def expire_batch(self, batch: ExportBatch, ttl_s: float) -> str | None:
        self._counters.batches_dropped += 1
        return (
            f"export batch {batch.batch_id} was not acknowledged in time and was dropped (no dump directory)"
        )

    def drain_batches(self, batches: list[ExportBatch]) -> Departure:
        self._counters.batches_dropped += len(batches)
        return BATCH_DRAIN_DROPPED
