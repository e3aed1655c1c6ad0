"""The session store: which sessions are live, which are detached for writing, which recently ended.

Every method is synchronous, so each runs atomically on the event loop. `lock` serialises the
multi-step operations that span awaits (cleanup, drain, export), as in: detach under the store lock,
then snapshot under the session's own lock, then write, then forget or reattach.

The store also keeps the admission numbers that follow from what it holds: `running` (unfinished
sessions held, live or detached), the ready queue (finished sessions, in the order they finished,
waiting for export), and the `accepted`/`rejected` counts as sessions finish or end unfinished.
"""

from __future__ import annotations

import asyncio
import hmac
from collections import OrderedDict
from collections.abc import Iterator
from typing import NamedTuple

from .failures import (
    SessionBeingWritten,
    SessionEnded,
    SessionExists,
    SessionLostInRestart,
    SessionsNotFinished,
    UnknownSession,
    UnknownSessions,
)
from .session import Session
from .stats import AdmissionCounters

# Matches no key's digest: an id the store holds no key for costs the same comparison as any other.
_NO_KEY_DIGEST = bytes(32)


class Tombstone(NamedTuple):
    """What an ended session leaves behind: why it ended, for the holder of its key alone."""

    reason: str
    key_digest: bytes


class SessionStore:
    def __init__(self, tombstone_capacity: int = 10000, admission: AdmissionCounters | None = None):
        self.lock = asyncio.Lock()
        self._live: dict[str, Session] = {}
        self._detached: dict[str, Session] = {}
        self._tombstones: OrderedDict[str, Tombstone] = OrderedDict()
        self._tombstone_capacity = tombstone_capacity
        self._ready: OrderedDict[str, Session] = OrderedDict()  # finished, held, in finish order
        self._lost: OrderedDict[str, str] = OrderedDict()  # journaled but not recoverable: id -> why
        self.admission = admission or AdmissionCounters()
        self.tokens_held = 0
        self.running = 0

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._live.values()))

    @property
    def detached_count(self) -> int:
        return len(self._detached)

    @property
    def ready_count(self) -> int:
        """Finished sessions held (trajectories not yet exported), including any being written."""
        return len(self._ready)

    def get(self, session_id: str) -> Session:
        """The live session, or the failure the admin key gets for that id (it may know them all)."""
        session = self._live.get(session_id)
        if session is not None:
            return session
        if session_id in self._detached:
            raise SessionBeingWritten(session_id)
        lost = self._lost.get(session_id)
        if lost is not None:
            raise SessionLostInRestart(session_id, lost)
        tombstone = self._tombstones.get(session_id)
        if tombstone is not None:
            raise SessionEnded(session_id, tombstone.reason)
        raise UnknownSession(session_id)

    def get_with_key(self, session_id: str, key_digest: bytes) -> Session:
        """As `get`, for the holder of the key with this digest. Any other key gets `UnknownSession`,
        whatever the store holds for the id, so that a key learns nothing about ids it does not open.
        A session lost in a restart left no key behind: it is unknown to every session key."""
        held = self._live.get(session_id) or self._detached.get(session_id)
        if held is not None:
            owner = held.key_digest
        else:
            tombstone = self._tombstones.get(session_id)
            owner = _NO_KEY_DIGEST if tombstone is None else tombstone.key_digest
        if not hmac.compare_digest(owner, key_digest):
            raise UnknownSession(session_id)
        return self.get(session_id)

    def all_sessions(self) -> list[Session]:
        """Every session held, live or detached (being written): what a snapshot must cover."""
        return [*self._live.values(), *self._detached.values()]

    @property
    def lost_count(self) -> int:
        return len(self._lost)

    def mark_lost(self, session_id: str, why: str) -> None:
        self._lost[session_id] = why
        self._lost.move_to_end(session_id)
        while len(self._lost) > max(self._tombstone_capacity, 1):
            self._lost.popitem(last=False)

    def add(self, session: Session) -> None:
        sid = session.session_id
        if sid in self._live or sid in self._detached:
            raise SessionExists(sid)
        self._tombstones.pop(sid, None)
        self._lost.pop(sid, None)
        self._live[sid] = session
        self.tokens_held += session.num_tokens
        if session.finished:
            self._ready[sid] = session
        else:
            self.running += 1

    def mark_finished(self, session: Session) -> bool:
        """Finish a live session: it produced a trajectory (accepted) and waits for export.
        Returns False when it was already finished."""
        if session.finished:
            return False
        session.finished = True
        self.running -= 1
        self.admission.accepted += 1
        self._ready[session.session_id] = session
        return True

    def record_growth(self, tokens: int) -> None:
        self.tokens_held += tokens

    def discard_new(self, session: Session) -> None:
        """Undo `add` of a session no client has heard of (its creation could not be journaled)."""
        del self._live[session.session_id]
        self.tokens_held -= session.num_tokens
        self.running -= 1

    def remove(self, session_id: str, reason: str) -> Session:
        """Remove a live session for good (DELETE): later calls get 404, as for any unknown id."""
        session = self.get(session_id)
        del self._live[session_id]
        self._end(session, reason, remember=False, final=True)
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

    def take_ready(self, limit: int) -> list[Session]:
        """Detach up to `limit` finished sessions, those that finished first first (for export)."""
        taken: list[Session] = []
        for session in self._ready.values():
            if len(taken) == limit:
                break
            if session.session_id in self._live and not session.busy:
                taken.append(session)
        for session in taken:
            self._detach(session)
        return taken

    def take_finished(self, session_ids: list[str]) -> list[Session]:
        """Detach exactly these finished sessions (for export), or none: the first problem found is
        raised, naming every id it applies to, and nothing is taken."""
        unknown = [
            sid
            for sid in session_ids
            if sid not in self._live and sid not in self._detached and sid not in self._tombstones
        ]
        if unknown:
            raise UnknownSessions(unknown)
        sessions = [self.get(sid) for sid in session_ids]  # being written, or ended
        unfinished = [s.session_id for s in sessions if not s.finished or s.busy]
        if unfinished:
            raise SessionsNotFinished(unfinished)
        for session in sessions:
            self._detach(session)
        return sessions

    def reattach(self, session: Session) -> None:
        """Put back a detached session whose write failed: it stays, and is retried later."""
        del self._detached[session.session_id]
        self._live[session.session_id] = session

    def forget(self, session: Session, reason: str, remember: bool = True) -> None:
        """Drop a detached session after it was written (or dropping was chosen explicitly).
        `remember=False` is for sessions that live on elsewhere (the drain's successor)."""
        del self._detached[session.session_id]
        self._end(session, reason, remember, final=remember)

    def _detach(self, session: Session) -> None:
        del self._live[session.session_id]
        self._detached[session.session_id] = session

    def _end(self, session: Session, reason: str, remember: bool, final: bool) -> None:
        """`final`: the session ends here, rather than continuing in the next process."""
        session.closed = True
        session.close_reason = reason
        self.tokens_held -= session.num_tokens
        if session.finished:
            self._ready.pop(session.session_id, None)
        else:
            self.running -= 1
            if final:  # ended without producing a trajectory
                self.admission.rejected += 1
        if remember and self._tombstone_capacity:
            self._tombstones[session.session_id] = Tombstone(reason, session.key_digest)
            self._tombstones.move_to_end(session.session_id)
            while len(self._tombstones) > self._tombstone_capacity:
                self._tombstones.popitem(last=False)
