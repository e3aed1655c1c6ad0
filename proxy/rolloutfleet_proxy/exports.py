"""Handing finished trajectories to the trainer: export, acknowledged drain, TTL dump, restart.

An export moves finished sessions out of the store into one batch in the export buffer, in the same
order as any other departure: detach under the store lock, serialize in a worker thread, then forget
them (or put them back if serializing failed). The batch is held until the trainer acknowledges it.
With a dump directory, a batch is written to `live-exports/` (and its sessions' departure journaled)
before the trainer gets it, so a killed proxy's successor still holds every unacknowledged batch;
the acknowledgement deletes the file. A batch never acknowledged within the TTL is moved to
`exported/` and freed. The restore leaves the files in place. Nothing is freed before it is written
somewhere, unless dropping was chosen and there is no dump directory. A kill between writing a
batch and journaling its sessions' departure brings those sessions back as well: delivered twice,
never lost (the trainer's ack decides).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from rolloutfleet_wire.errors import ErrorCode
from rolloutfleet_wire.export_format import decode_batch, encode_batch
from rolloutfleet_wire.session_tree import SampleShape

from .dumps import (
    EXPORTED_AREA,
    LIVE_EXPORTS_AREA,
    dump_file_path,
    list_live_dumps,
    quarantine,
    write_batch_dump,
)
from .export_buffer import ExportBatch, ExportBuffer, new_batch
from .failures import Failure
from .generation import GenerationControl
from .ids import new_batch_id
from .session_log import SessionLog
from .stats import Counters
from .store import SessionStore

log = logging.getLogger("rolloutfleet.proxy.exports")

DRAIN_WRITE_ATTEMPTS = 3


class ExportService:
    def __init__(
        self,
        store: SessionStore,
        buffer: ExportBuffer,
        generation: GenerationControl,
        counters: Counters,
        dump_dir: Path | None,
        ttl_s: float,
        drop_without_dump: bool,
        session_log: SessionLog | None = None,
    ):
        self._log = session_log or SessionLog(None, None)  # type: ignore[arg-type]
        self._store = store
        self.buffer = buffer
        self._generation = generation
        self._counters = counters
        self._dump_dir = dump_dir
        self.ttl_s = ttl_s
        self._drop_without_dump = drop_without_dump
        # Batches being built: the shutdown drain waits for them, or one finishing after the drain
        # wrote the buffer would be lost.
        self._building = 0
        self._none_building = asyncio.Event()
        self._none_building.set()

    @property
    def sweep_interval_s(self) -> float:
        """Often enough that a batch outlives its TTL by at most a quarter of it (and at most 1 s)."""
        return min(1.0, max(0.01, self.ttl_s / 4))

    async def export(
        self, session_ids: list[str] | None, max_trajectories: int, shape: SampleShape | None = None
    ) -> ExportBatch | None:
        """Move the named finished sessions (all or none), or the next `max_trajectories` ready ones,
        into a new batch, each as the samples `shape` asks. None when nothing is ready."""
        self._building += 1
        self._none_building.clear()
        try:
            async with self._store.lock:
                if session_ids is not None:
                    sessions = self._store.take_finished(session_ids)
                else:
                    sessions = self._store.take_ready(max_trajectories)
            if not sessions:
                return None
            batch_id = new_batch_id()
            # Detached and finished: no turn, reward or finish can reach them, so no session lock.
            records = [s.to_record() for s in sessions]
            try:
                data = await asyncio.to_thread(
                    encode_batch, batch_id, records, self._generation.model_version, shape
                )
            except Exception:
                for session in sessions:
                    self._store.reattach(session)
                raise
            if self._log.enabled:
                await self._persist(batch_id, data, sessions)
            reason = f"exported to the trainer in batch {batch_id}"
            for session in sessions:
                self._store.forget(session, reason)
            batch = new_batch(
                batch_id,
                data,
                [r.session_id for r in records],
                sum(len(r.token_ids) for r in records),
                self.ttl_s,
            )
            self.buffer.add(batch)
            self._counters.batches_exported += 1
            self._counters.trajectories_exported += batch.num_trajectories
            return batch
        finally:
            self._building -= 1
            if self._building == 0:
                self._none_building.set()

    async def _persist(self, batch_id: str, data: bytes, sessions: list) -> None:
        """The batch file first, then the sessions' departure: if either fails, the sessions go back
        and the trainer gets 503 (nothing was handed over)."""
        assert self._dump_dir is not None
        try:
            self._log.require_writable("nothing was exported")
            await asyncio.to_thread(write_batch_dump, self._dump_dir, LIVE_EXPORTS_AREA, batch_id, data)
        except (OSError, Failure) as exc:
            for session in sessions:
                self._store.reattach(session)
            if isinstance(exc, Failure):
                raise
            self._counters.dump_failures += 1
            self._log.health.fail(f"writing export batch {batch_id} failed: {exc}")
            raise self._log.health.refuse("nothing was exported") from None
        reason = f"exported to the trainer in batch {batch_id}"
        try:
            pending = [self._log.ended(s, reason) for s in sessions]
            for item in pending:
                await self._log.commit(item)
        except Failure:
            # Not journaled: the sessions stay, and the batch file must not outlive this refusal.
            for session in sessions:
                self._store.reattach(session)
            await asyncio.to_thread(self._remove_file, batch_id)
            raise

    def _remove_file(self, batch_id: str) -> None:
        """Blocking: delete a batch's `live-exports/` file (acknowledged, expired or not handed over)."""
        if self._dump_dir is not None:
            dump_file_path(self._dump_dir, LIVE_EXPORTS_AREA, batch_id).unlink(missing_ok=True)

    async def acknowledge(self, batch_id: str) -> ExportBatch:
        """The trainer has the batch: delete its file, then free it. A file that cannot be deleted
        only means the batch may be offered again after a restart."""
        batch = self.buffer.get(batch_id)
        try:
            await asyncio.to_thread(self._remove_file, batch_id)
        except OSError as exc:
            self._counters.dump_failures += 1
            log.error("cannot delete the file of acknowledged batch %s: %s", batch_id, exc)
        if batch_id in self.buffer:
            batch = self.buffer.acknowledge(batch_id)
        else:
            self.buffer.get(batch_id)  # acknowledged meanwhile: the 410 of a second acknowledgement
        return batch

    async def sweep(self) -> int:
        """Write every batch past its TTL to `exported/` and free it; returns how many were freed.
        A failed write keeps the batch (still readable and acknowledgeable); the next sweep retries."""
        expired = self.buffer.expired(time.monotonic())
        if not expired:
            return 0
        if self._dump_dir is None:
            for batch in expired:
                self.buffer.release(
                    batch,
                    ErrorCode.BATCH_EXPIRED,
                    f"export batch {batch.batch_id} was not acknowledged in time "
                    "and was dropped (no dump directory)",
                )
            self._counters.batches_dropped += len(expired)
            return len(expired)
        freed = 0
        for batch in expired:
            try:
                path = await asyncio.to_thread(
                    write_batch_dump, self._dump_dir, EXPORTED_AREA, batch.batch_id, batch.data
                )
            except Exception as exc:
                batch.writing = False
                self._counters.dump_failures += 1
                log.error("dump of export batch %s failed: %s: %s", batch.batch_id, type(exc).__name__, exc)
                continue
            if batch.acknowledged:  # acknowledged during the write: the trainer has it, no copy on disk
                await asyncio.to_thread(path.unlink, missing_ok=True)
                continue
            try:
                await asyncio.to_thread(self._remove_file, batch.batch_id)
            except OSError as exc:
                log.error("cannot delete live-exports file of expired batch %s: %s", batch.batch_id, exc)
            self.buffer.release(
                batch,
                ErrorCode.BATCH_EXPIRED,
                f"export batch {batch.batch_id} was not acknowledged within {self.ttl_s:g}s; "
                f"it was written to {path}",
            )
            self._counters.batches_expired += 1
            freed += 1
            log.warning(
                "export batch %s not acknowledged within %gs; written to %s", batch.batch_id, self.ttl_s, path
            )
        return freed

    async def quiesce(self) -> None:
        """Wait for batches being built (the drain calls this once exports are refused): a batch
        finished after the drain wrote the buffer, or a session put back after a failed build, would
        be missed."""
        await self._none_building.wait()

    async def write_for_shutdown(self) -> bool:
        """Write every held batch to `live-exports/` for the next process; False if some could not be."""
        pending = list(self.buffer)
        if self._dump_dir is None:
            for batch in pending:
                self.buffer.release(batch, ErrorCode.DRAINING, "dropped at shutdown (no dump directory)")
            self._counters.batches_dropped += len(pending)
            return True
        if self._log.enabled:  # written when exported; the files are the next process's copy
            for batch in pending:
                self.buffer.release(batch, ErrorCode.DRAINING, "written for the next process", remember=False)
                self._counters.batches_drained += 1
            return True
        for attempt in range(DRAIN_WRITE_ATTEMPTS):
            failed = []
            for batch in pending:
                try:
                    await asyncio.to_thread(
                        write_batch_dump, self._dump_dir, LIVE_EXPORTS_AREA, batch.batch_id, batch.data
                    )
                except Exception as exc:
                    self._counters.dump_failures += 1
                    log.error("drain of export batch %s failed: %s", batch.batch_id, exc)
                    failed.append(batch)
                    continue
                self.buffer.release(batch, ErrorCode.DRAINING, "written for the next process", remember=False)
                self._counters.batches_drained += 1
            pending = failed
            if not pending:
                return True
            await asyncio.sleep(0.2 * (attempt + 1))
        log.critical(
            "drain could not write %d export batches: %s",
            len(pending),
            ", ".join(b.batch_id for b in pending[:20]),
        )
        return False

    async def restore(self) -> int:
        """Bring back the batches a predecessor held, with a fresh TTL. With a journal the files stay
        until acknowledged (a second kill loses nothing); without one they are deleted."""
        if self._dump_dir is None:
            return 0
        restored = 0
        for path in await asyncio.to_thread(list_live_dumps, self._dump_dir, LIVE_EXPORTS_AREA):
            try:
                data = await asyncio.to_thread(path.read_bytes)
                decoded = await asyncio.to_thread(decode_batch, data)
            except Exception as exc:
                self._counters.restore_failures += 1
                target = await asyncio.to_thread(quarantine, path, self._dump_dir)
                log.error("cannot restore export batch %s (%s); kept as %s", path, exc, target)
                continue
            if decoded.batch_id in self.buffer:
                self._counters.restore_failures += 1
                log.error(
                    "cannot restore %s: batch %s is already held; the file is kept", path, decoded.batch_id
                )
                continue
            batch = ExportBatch(
                batch_id=decoded.batch_id,
                data=data,
                session_ids=[t["session_id"] for t in decoded.header["trajectories"]],
                num_tokens=len(decoded.tensors["input_ids"]),
                created_at=float(decoded.header.get("created_at", time.time())),
                expires_at=time.monotonic() + self.ttl_s,
            )
            del decoded
            self.buffer.add(batch)
            if not self._log.enabled:  # without a journal nothing else keeps it
                await asyncio.to_thread(path.unlink)
            self._counters.batches_restored += 1
            restored += 1
        return restored
