"""The one interface to what the proxy keeps beyond its memory, and the values it answers with.

Two implementations, chosen once by the runtime: `DumpStorage` (a dump directory: the journal, the
snapshots, stale dumps, export batch files and the state file) and `NoStorage` (no dump directory,
because dropping sessions was chosen). Callers never ask which one they hold: whatever leaves memory
goes through here, and the storage says what became of it.

The rule for the journal calls (`created`, `turn`, `rewarded`, `finished`, `ended`): apply the change
in memory, call the matching method in the same synchronous step (so the journal's order is the order
of the changes), then `await commit(...)` before answering.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..export_buffer import ExportBatch
from ..periodic import PeriodicTask
from ..session import RecordedTurn, Session
from .health import StorageHealth
from .images import ImageStore
from .journal import JournalStats
from .routing_store import RoutingStore
from .state_file import ProxyState

# What `commit` waits for: the record's sync (durability sync), or nothing.
Pending = asyncio.Future | None


@dataclass(frozen=True)
class Departure:
    """What became of what left memory through the storage: the reason its id answers with from now
    on, and whether it lives on in the next process (then its end is not remembered here)."""

    reason: str
    lives_on: bool = False


@dataclass
class Written:
    """Sessions handed to the storage to leave memory: those that left (`done`, as `departure` says)
    and those whose write failed (`failed`: put them back; nothing is lost)."""

    departure: Departure
    done: list[Session]
    failed: list[Session]


@dataclass
class RestoredSessions:
    sessions: list[Session]
    lost: dict[str, str]  # session id -> why it could not be restored


class Storage(ABC):
    health: StorageHealth
    images: ImageStore  # the images sessions reference, stored once (files, or memory without storage)
    routing: RoutingStore  # routing replay's rows of routed turns (files, or memory without storage)

    # --- start and stop ---------------------------------------------------------------------------

    @abstractmethod
    async def open(self) -> None:
        """Before anything else at start: RuntimeError when nothing could be kept (the proxy must not
        serve, then lose every session)."""

    @abstractmethod
    async def restore_state(self) -> ProxyState | None:
        """The model version, pause and admission counters a predecessor saved, if any."""

    @abstractmethod
    async def restore_sessions(self) -> RestoredSessions:
        """The sessions a predecessor held; then the journal takes new records."""

    @abstractmethod
    async def restore_batches(self, ttl_s: float) -> list[ExportBatch]:
        """The export batches a predecessor held and the trainer has not acknowledged."""

    @abstractmethod
    def background_tasks(self, writes: asyncio.Lock, finished: Callable[[], bool]) -> list[PeriodicTask]:
        """The storage's own periodic work; runs that write sessions hold `writes` and end once
        `finished` (the drain takes the same lock)."""

    @abstractmethod
    async def close(self) -> None:
        """Flush what is queued; later journal calls are refused."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """`storage_writable`, `storage`, `journal_bytes` and `journal` of the /stats document."""

    # --- the journal: one call per change a client is told about -----------------------------------

    @abstractmethod
    def require_writable(self, what: str) -> None:
        """Refuse work up front while nothing could be persisted (before spending a generation)."""

    @abstractmethod
    def created(self, session: Session) -> Pending: ...

    @abstractmethod
    def turn(self, session: Session, turn_index: int, turn: RecordedTurn) -> Pending: ...

    @abstractmethod
    def rewarded(self, session: Session, value: float, turn: int | None) -> Pending: ...

    @abstractmethod
    def finished(self, session: Session) -> Pending: ...

    @abstractmethod
    def ended(self, session: Session, reason: str) -> Pending:
        """The session left this proxy (deleted, written to stale/, exported): a restore forgets it."""

    @abstractmethod
    async def commit(self, pending: Pending) -> None:
        """Wait until the change is durable; a Failure (storage_unavailable) when it cannot be."""

    # --- the state file ---------------------------------------------------------------------------

    @abstractmethod
    async def save_state(self) -> bool:
        """Persist the model version, pause and admission counters now; False when that failed."""

    # --- sessions leaving memory (detached from the store first) ------------------------------------

    @abstractmethod
    async def write_stale(self, sessions: list[Session]) -> Written:
        """Sessions idle past the stale-session timeout."""

    @abstractmethod
    async def write_drained(self, sessions: list[Session]) -> Written:
        """Sessions the shutdown drain hands to the next process."""

    @abstractmethod
    async def drained(self, session_ids: set[str]) -> None:
        """The drain wrote every session it held (`session_ids`): what the journal holds is redundant."""

    # --- export batches ---------------------------------------------------------------------------

    @abstractmethod
    async def keep_batch(self, batch_id: str, data: bytes, sessions: list[Session], reason: str) -> None:
        """Before the trainer gets a batch: keep it, and journal its sessions' departure (`reason`).
        A Failure when it could not be kept: nothing was handed over, the sessions go back."""

    @abstractmethod
    async def batch_acknowledged(self, batch_id: str) -> None:
        """The trainer has the batch: its copy goes (a copy left over only means it may come back)."""

    @abstractmethod
    async def expire_batch(self, batch: ExportBatch, ttl_s: float) -> str | None:
        """A batch past its TTL (`ttl_s`): what to tell about it once it is freed; None when it stays
        held (its write failed: the next sweep retries) or was acknowledged meanwhile."""

    @abstractmethod
    def drain_batches(self, batches: list[ExportBatch]) -> Departure:
        """What becomes of the batches held at shutdown."""


def storage_stats(
    health: StorageHealth,
    durability: str,
    journal: JournalStats,
    journal_bytes: int,
    last_compaction_seconds: float,
    compacting: bool,
) -> dict[str, Any]:
    """The storage's part of the /stats document."""
    return {
        "storage_writable": health.ok,
        "storage": {
            "writable": health.ok,
            "reason": health.reason,
            "since": health.since,
            "failures": health.failures,
            "durability": durability,
        },
        "journal_bytes": journal_bytes,
        "journal": {
            "records": journal.records,
            "syncs": journal.syncs,
            "bytes_written": journal.bytes_written,
            "write_failures": journal.write_failures,
            "segments": len(journal.sizes),
            "segments_retired": journal.segments_retired,
            "commit_wait_mean_ms": round(1000 * journal.commit_wait_s / journal.commits, 3)
            if journal.commits
            else 0.0,
            "last_compaction_seconds": last_compaction_seconds,
            "compacting": compacting,
        },
    }
