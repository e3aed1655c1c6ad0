"""A dump directory: everything a client was told about survives this process.

Its layout (the file formats are in dumps.py):
    journal/<seq>.wal                          every change a client was told about (journal.py)
    live/<session_id>.safetensors              snapshots (compaction, the shutdown drain); restored on start
    stale/<session_id>.<unix_ms>.safetensors   sessions evicted after idling (the user's); their images in
                                               stale/images/ (hard links to images/ files)
    images/<sha256>.<png|jpg|webp>             each distinct image of the sessions held, once (images.py)
    routing/<session_id>.<incarnation>.r3      routing replay's rows of each session held (routing_store.py);
                                               a stale session's beside its dump, in stale/routing/
    live-exports/<batch_id>.safetensors        batches handed to the trainer, not yet acknowledged
    exported/<batch_id>.<unix_ms>.safetensors  batches never acknowledged within the TTL (the user's)
    corrupt/                                   files that could not be read back
    lost-sessions.json, state.json             sessions a restore could not rebuild; version, pause, counters

Nothing leaves memory before it is written somewhere: a session that leaves (stale, drained,
exported) is written first and its departure journaled, and a failed write puts it back. A batch is
written to `live-exports/` (and its sessions' departure journaled) before the trainer gets it, so a
killed proxy's successor still holds every unacknowledged batch; the acknowledgement deletes the
file. A kill between writing a batch and journaling its sessions' departure brings those sessions
back as well: delivered twice, never lost (the trainer's ack decides).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rolloutfleet_wire import session_tree as tree

from ..export_buffer import ExportBatch
from ..failures import Failure
from ..periodic import PeriodicTask
from ..session import RecordedTurn, Session
from ..stats import Counters
from . import journal_records as records
from .compaction import Compactor
from .dumps import (
    EXPORTED_AREA,
    LIVE_AREA,
    LIVE_EXPORTS_AREA,
    STALE_AREA,
    check_writable,
    dump_file_path,
    probe_writable,
    remove_other_dumps,
    write_atomic,
    write_batch_dump,
)
from .health import StorageHealth
from .images import IMAGES_AREA, ImageStore
from .interface import Departure, Pending, RestoredSessions, Storage, Written, storage_stats
from .journal import Journal, journal_dir
from .restore import restore_batches, restore_sessions, restore_state
from .routing_store import ROUTING_AREA, RoutingFiles, record_key
from .session_files import SessionFiles
from .state_file import FLUSH_INTERVAL_S, ProxyState, StateKeeper

log = logging.getLogger("rolloutfleet.proxy")
exports_log = logging.getLogger("rolloutfleet.proxy.exports")

COMPACTION_CHECK_INTERVAL_S = 1.0
STALE_DUMPED = Departure("idle past the stale-session timeout; dumped to disk")
DRAINED = Departure("written to the live area for the next process", lives_on=True)
# Written to live-exports/ when exported: the files are the next process's copy.
BATCHES_DRAINED = Departure("written for the next process", lives_on=True)


class DumpStorage(Storage):
    def __init__(
        self,
        dump_dir: Path,
        counters: Counters,
        *,
        held_sessions: Callable[[], list[Session]],
        state: Callable[[], ProxyState],
        durability: str,
        journal_flush_interval_s: float,
        journal_compact_bytes: int,
        check_interval_s: float,
        write_concurrency: int,
        lost_capacity: int,
    ):
        """`held_sessions`: every session held, live or detached (what a compaction snapshots);
        `state`: the state file's content now."""
        self.health = StorageHealth()
        self.images = ImageStore(dump_dir / IMAGES_AREA)
        self.routing: RoutingFiles = RoutingFiles(dump_dir / ROUTING_AREA, self._routing_failed)
        self._dump_dir = dump_dir
        self._counters = counters
        self._durability = durability
        self._compact_bytes = journal_compact_bytes
        self._check_interval_s = check_interval_s
        self._lost_capacity = lost_capacity
        self._journal = Journal(journal_dir(dump_dir), self.health, durability, journal_flush_interval_s)
        self._files = SessionFiles(dump_dir, write_concurrency, counters)
        self._state = StateKeeper(dump_dir, state, counters)
        self._compactor = Compactor(
            held_sessions, self._files, self._journal, dump_dir, counters, self.routing
        )

    def _routing_failed(self, exc: OSError) -> Exception:
        self._counters.dump_failures += 1
        self.health.fail(f"routing replay write failed: {type(exc).__name__}: {exc}")
        return self.health.refuse("not recorded")

    # --- start and stop ---------------------------------------------------------------------------

    async def open(self) -> None:
        await asyncio.to_thread(check_writable, self._dump_dir)

    async def restore_state(self) -> ProxyState | None:
        return await restore_state(self._dump_dir, self._counters)

    async def restore_sessions(self) -> RestoredSessions:
        recovered = await restore_sessions(
            self._dump_dir, self._lost_capacity, self._counters, self.routing.shape
        )
        self.routing.adopt(recovered.routing_sizes)
        await self._journal.open(recovered.last_seq)
        return RestoredSessions(list(recovered.sessions.values()), recovered.lost)

    async def restore_batches(self, ttl_s: float) -> list[ExportBatch]:
        return await restore_batches(self._dump_dir, ttl_s, self._counters)

    def background_tasks(self, writes: asyncio.Lock, finished: Callable[[], bool]) -> list[PeriodicTask]:
        def count_compaction_failure() -> None:
            self._counters.compaction_failures += 1

        return [
            # Counters change with every session, too often for a write each.
            PeriodicTask("state-flush", FLUSH_INTERVAL_S, self._state.flush_if_changed),
            # Honest readiness even when no request writes.
            PeriodicTask("storage-check", self._check_interval, self.check),
            PeriodicTask(
                "journal-compaction",
                COMPACTION_CHECK_INTERVAL_S,
                self._compactor.compact,
                lock=writes,  # not during a cleanup cycle's writes
                due=self._compaction_due,
                finished=finished,
                on_failure=count_compaction_failure,
            ),
        ]

    async def close(self) -> None:
        await self._journal.close()

    def stats(self) -> dict[str, Any]:
        journal, compactor = self._journal, self._compactor
        return storage_stats(
            self.health,
            self._durability,
            journal.stats,
            journal.total_bytes,
            compactor.last_seconds,
            compactor.running,
        )

    def _check_interval(self) -> float:
        return self._check_interval_s if self.health.ok else min(self._check_interval_s, 1.0)

    async def check(self) -> bool:
        """Probe the dump volume (write + fsync)."""
        try:
            await asyncio.to_thread(probe_writable, self._dump_dir)
        except OSError as exc:
            self.health.fail(f"{type(exc).__name__}: {exc}")
            return False
        self.health.recover()
        return True

    def _compaction_due(self) -> bool:
        return self._journal.total_bytes >= self._compact_bytes and self.health.ok

    # --- the journal ------------------------------------------------------------------------------

    def require_writable(self, what: str) -> None:
        if not self.health.ok:
            raise self.health.refuse(what)

    def created(self, session: Session) -> Pending:
        return self._journal.append(
            records.create_record(
                session.session_id, session.key_digest, session.created_at, session.metadata
            )
        )

    def turn(self, session: Session, turn_index: int, turn: RecordedTurn) -> Pending:
        return self._journal.append(
            records.turn_record(session.session_id, session.key_digest, turn_index, turn)
        )

    def rewarded(self, session: Session, value: float, turn: int | None) -> Pending:
        return self._journal.append(
            records.reward_record(session.session_id, session.key_digest, value, turn)
        )

    def finished(self, session: Session) -> Pending:
        return self._journal.append(records.finish_record(session.session_id, session.key_digest))

    def ended(self, session: Session, reason: str) -> Pending:
        return self._journal.append(records.end_record(session.session_id, session.key_digest, reason))

    async def commit(self, pending: Pending) -> None:
        await self._journal.commit(pending)

    async def save_state(self) -> bool:
        return await self._state.save()

    # --- sessions leaving memory ------------------------------------------------------------------

    async def write_stale(self, sessions: list[Session]) -> Written:
        # Stale dumps are the user's: their images go beside them (hard links: no copy), so they
        # stay readable after the image store deletes its own files.
        digests: set[bytes] = set()
        for session in sessions:
            digests |= tree.image_digests_of(session)
        if digests:
            try:
                await asyncio.to_thread(self._link_images, digests, self._dump_dir / STALE_AREA / IMAGES_AREA)
            except OSError as exc:
                self._counters.dump_failures += 1
                log.error("the images of stale sessions could not be kept beside them: %s", exc)
                return Written(STALE_DUMPED, [], sessions)
        try:  # and their routing replay rows (the journal holding them goes)
            keys = [record_key(s) for s in sessions]
            await asyncio.to_thread(self.routing.link_into, keys, self._dump_dir / STALE_AREA / ROUTING_AREA)
        except OSError as exc:
            self._counters.dump_failures += 1
            log.error("the routing of stale sessions could not be kept beside them: %s", exc)
            return Written(STALE_DUMPED, [], sessions)
        written, failed = await self._files.write(sessions, STALE_AREA, "stale")
        self._counters.sessions_dumped += len(written)
        self._counters.sessions_evicted += len(written)
        return Written(STALE_DUMPED, written, failed)

    async def write_drained(self, sessions: list[Session]) -> Written:
        written, failed = await self._files.write(sessions, LIVE_AREA, "drain")
        self._counters.sessions_drained += len(written)
        return Written(DRAINED, written, failed)

    def _link_images(self, digests: set[bytes], directory: Path) -> None:
        """Blocking: each image's file linked (copied where links fail) into `directory`, fsynced."""
        directory.mkdir(parents=True, exist_ok=True)
        for digest in digests:
            source = self.images.path(self.images.info(digest))
            target = directory / source.name
            if target.exists():
                continue
            try:
                os.link(source, target)
            except OSError:
                write_atomic(target, source.read_bytes())
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    async def drained(self, session_ids: set[str]) -> None:
        """Every session is in its live/ snapshot now: the journal and older snapshots are redundant.
        A failure here loses nothing (the next start replays the journal over the snapshots)."""
        try:
            await self._journal.close()
            await asyncio.to_thread(self.routing.sync, list(self.routing.keys()))
            await asyncio.to_thread(remove_other_dumps, self._dump_dir, LIVE_AREA, session_ids)
            await self._journal.retire(self._journal.segment_seq + 1)
        except OSError as exc:
            log.warning("drain: the journal could not be retired (%s); the next start replays it", exc)

    # --- export batches ---------------------------------------------------------------------------

    async def keep_batch(self, batch_id: str, data: bytes, sessions: list[Session], reason: str) -> None:
        """The batch file first, then the sessions' departure."""
        self.require_writable("nothing was exported")
        try:
            await asyncio.to_thread(write_batch_dump, self._dump_dir, LIVE_EXPORTS_AREA, batch_id, data)
        except OSError as exc:
            self._counters.dump_failures += 1
            self.health.fail(f"writing export batch {batch_id} failed: {exc}")
            raise self.health.refuse("nothing was exported") from None
        try:
            pending = [self.ended(s, reason) for s in sessions]
            for item in pending:
                await self.commit(item)
        except Failure:
            # Not journaled: the batch file must not outlive this refusal.
            await asyncio.to_thread(self._remove_batch_file, batch_id)
            raise

    def _remove_batch_file(self, batch_id: str) -> None:
        """Blocking: delete a batch's `live-exports/` file (acknowledged, expired or not handed over)."""
        dump_file_path(self._dump_dir, LIVE_EXPORTS_AREA, batch_id).unlink(missing_ok=True)

    async def batch_acknowledged(self, batch_id: str) -> None:
        try:
            await asyncio.to_thread(self._remove_batch_file, batch_id)
        except OSError as exc:
            self._counters.dump_failures += 1
            exports_log.error("cannot delete the file of acknowledged batch %s: %s", batch_id, exc)

    async def expire_batch(self, batch: ExportBatch, ttl_s: float) -> str | None:
        """Written to `exported/`, then its `live-exports/` file removed."""
        try:
            path = await asyncio.to_thread(
                write_batch_dump, self._dump_dir, EXPORTED_AREA, batch.batch_id, batch.data
            )
        except Exception as exc:
            self._counters.dump_failures += 1
            exports_log.error(
                "dump of export batch %s failed: %s: %s", batch.batch_id, type(exc).__name__, exc
            )
            return None
        if batch.acknowledged:  # acknowledged during the write: the trainer has it, no copy on disk
            await asyncio.to_thread(path.unlink, missing_ok=True)
            return None
        try:
            await asyncio.to_thread(self._remove_batch_file, batch.batch_id)
        except OSError as exc:
            exports_log.error("cannot delete live-exports file of expired batch %s: %s", batch.batch_id, exc)
        self._counters.batches_expired += 1
        exports_log.warning(
            "export batch %s not acknowledged within %gs; written to %s", batch.batch_id, ttl_s, path
        )
        return (
            f"export batch {batch.batch_id} was not acknowledged within {ttl_s:g}s; it was written to {path}"
        )

    def drain_batches(self, batches: list[ExportBatch]) -> Departure:
        self._counters.batches_drained += len(batches)
        return BATCHES_DRAINED
