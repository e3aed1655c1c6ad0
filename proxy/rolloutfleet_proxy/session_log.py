"""What the request handlers journal: one call per state change a client is told about.

The rule at every call site: apply the change in memory, call the matching method here in the same
synchronous step (so the journal's order is the order of the changes), then `await commit(...)`
before answering. Without a dump directory (dropping sessions was chosen) nothing is journaled.
"""

from __future__ import annotations

import asyncio

from . import journal_records as records
from .journal import Journal, StorageHealth
from .session import RecordedTurn, Session


class SessionLog:
    def __init__(self, journal: Journal | None, health: StorageHealth):
        self.journal = journal
        self.health = health

    @property
    def enabled(self) -> bool:
        return self.journal is not None

    def require_writable(self, what: str) -> None:
        """Refuse work up front while nothing could be persisted (before spending a generation)."""
        if self.journal is not None and not self.health.ok:
            raise self.health.refuse(what)

    def _append(self, data_factory) -> asyncio.Future | None:
        if self.journal is None:
            return None
        return self.journal.append(data_factory())

    def created(self, session: Session) -> asyncio.Future | None:
        return self._append(
            lambda: records.create_record(
                session.session_id, session.key_digest, session.created_at, session.metadata
            )
        )

    def turn(self, session: Session, turn_index: int, turn: RecordedTurn) -> asyncio.Future | None:
        return self._append(
            lambda: records.turn_record(session.session_id, session.key_digest, turn_index, turn)
        )

    def rewarded(self, session: Session, value: float, turn: int | None) -> asyncio.Future | None:
        return self._append(
            lambda: records.reward_record(session.session_id, session.key_digest, value, turn)
        )

    def finished(self, session: Session) -> asyncio.Future | None:
        return self._append(lambda: records.finish_record(session.session_id, session.key_digest))

    def ended(self, session: Session, reason: str) -> asyncio.Future | None:
        """The session left this proxy (deleted, written to stale/, exported): replay forgets it."""
        return self._append(lambda: records.end_record(session.session_id, session.key_digest, reason))

    async def commit(self, pending: asyncio.Future | None) -> None:
        if self.journal is not None:
            await self.journal.commit(pending)
