"""The session store: which sessions are live, which are detached for writing, which recently ended.

Every method is synchronous, so each runs atomically on the event loop. `lock` serialises the
multi-step operations that span awaits (cleanup, drain), as in: detach under the store lock, then
snapshot under the session's own lock, then write, then forget or reattach.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Iterator

from .errors import ProxyError, conflict, gone, not_found
from .session import Session


class SessionStore:
    def __init__(self, tombstone_capacity: int = 10000):
        self.lock = asyncio.Lock()
        self._live: dict[str, Session] = {}
        self._detached: dict[str, Session] = {}
        self._tombstones: OrderedDict[str, str] = OrderedDict()
        self._tombstone_capacity = tombstone_capacity
        self.tokens_held = 0

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._live.values()))

    @property
    def detached_count(self) -> int:
        return len(self._detached)

    def get(self, session_id: str) -> Session:
        """The live session, or the error a client should see for that id."""
        session = self._live.get(session_id)
        if session is not None:
            return session
        if session_id in self._detached:
            raise ProxyError(
                409,
                "session_busy",
                f"session {session_id} is being written to disk; retry",
                {"Retry-After": "1"},
            )
        reason = self._tombstones.get(session_id)
        if reason is not None:
            raise gone("session_gone", f"session {session_id} has ended: {reason}")
        raise not_found(f"unknown session {session_id}")

    def add(self, session: Session) -> None:
        sid = session.session_id
        if sid in self._live or sid in self._detached:
            raise conflict("session_exists", f"session {sid} already exists")
        self._tombstones.pop(sid, None)
        self._live[sid] = session
        self.tokens_held += session.num_tokens

    def record_growth(self, tokens: int) -> None:
        self.tokens_held += tokens

    def remove(self, session_id: str, reason: str) -> Session:
        """Remove a live session for good (DELETE): later calls get 404, as for any unknown id."""
        session = self.get(session_id)
        del self._live[session_id]
        self._end(session, reason, remember=False)
        return session

    def detach_stale(self, now: float, timeout_s: float) -> list[Session]:
        """Take idle sessions out of reach of clients; sessions in a turn are never stale."""
        stale = [s for s in self._live.values() if not s.busy and s.idle_seconds(now) >= timeout_s]
        for session in stale:
            self._detach(session)
        return stale

    def detach_all(self) -> list[Session]:
        sessions = [s for s in self._live.values() if not s.busy]
        for session in sessions:
            self._detach(session)
        return sessions

    def reattach(self, session: Session) -> None:
        """Put back a detached session whose write failed: it stays, and is retried later."""
        del self._detached[session.session_id]
        self._live[session.session_id] = session

    def forget(self, session: Session, reason: str, remember: bool = True) -> None:
        """Drop a detached session after it was written (or dropping was chosen explicitly)."""
        del self._detached[session.session_id]
        self._end(session, reason, remember)

    def _detach(self, session: Session) -> None:
        del self._live[session.session_id]
        self._detached[session.session_id] = session

    def _end(self, session: Session, reason: str, remember: bool = True) -> None:
        session.closed = True
        session.close_reason = reason
        self.tokens_held -= session.num_tokens
        if remember and self._tombstone_capacity:
            self._tombstones[session.session_id] = reason
            self._tombstones.move_to_end(session.session_id)
            while len(self._tombstones) > self._tombstone_capacity:
                self._tombstones.popitem(last=False)
