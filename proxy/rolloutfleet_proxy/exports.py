"""Handing finished trajectories to the trainer: export, acknowledged drain, expiry, restart.

An export moves finished sessions out of the store into one batch in the export buffer, in the same
order as any other departure: detach under the store lock, serialize in a worker thread and hand the
batch to the storage (which keeps it before the trainer gets it, and journals its sessions'
departure), then forget them; if serializing or keeping failed they go back, and the trainer gets
the failure (nothing was handed over). The batch is held until the trainer acknowledges it. A batch
never acknowledged within the TTL is given to the storage (written to `exported/`, or dropped
without storage) and freed. What the storage does with batches is in storage/dump_storage.py.
"""

from __future__ import annotations

import asyncio
import time

from rolloutfleet_wire.errors import ErrorCode
from rolloutfleet_wire.export_format import ExportImages, ExportRouting, encode_batch
from rolloutfleet_wire.session_tree import SampleShape, image_digests_of

from .export_buffer import ExportBatch, ExportBuffer, new_batch
from .generation import GenerationControl
from .ids import new_batch_id
from .stats import Counters
from .storage import Storage
from .store import SessionStore


class ExportService:
    def __init__(
        self,
        store: SessionStore,
        buffer: ExportBuffer,
        generation: GenerationControl,
        counters: Counters,
        storage: Storage,
        ttl_s: float,
    ):
        self._store = store
        self.buffer = buffer
        self._generation = generation
        self._counters = counters
        self._storage = storage
        self.ttl_s = ttl_s
        # Set at start for a vision-language model: batches then carry their images' bytes and the
        # processor configuration.
        self.images: ExportImages | None = None
        # Set at start with routing replay: batches then carry each sample's routing rows.
        self.routing: ExportRouting | None = None
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
            reason = f"exported to the trainer in batch {batch_id}"
            # Detached and finished: no turn, reward or finish can reach them, so no session lock.
            records = [s.to_record() for s in sessions]
            try:
                data = await asyncio.to_thread(
                    encode_batch,
                    batch_id,
                    records,
                    self._generation.model_version,
                    shape,
                    self.images,
                    self.routing,
                )
                await self._storage.keep_batch(batch_id, data, sessions, reason)
            except Exception:
                for session in sessions:
                    self._store.reattach(session)
                raise
            # No await from here on: the sessions' images pass from the store's references to the
            # batch's in one step, so a cleanup cycle never sees them unreferenced.
            for session in sessions:
                self._store.forget(session, reason)
            batch = new_batch(
                batch_id,
                data,
                [r.session_id for r in records],
                sum(len(r.token_ids) for r in records),
                self.ttl_s,
                frozenset().union(*(image_digests_of(r) for r in records)),
            )
            self.buffer.add(batch)
            self._counters.batches_exported += 1
            self._counters.trajectories_exported += batch.num_trajectories
            return batch
        finally:
            self._building -= 1
            if self._building == 0:
                self._none_building.set()

    async def acknowledge(self, batch_id: str) -> ExportBatch:
        """The trainer has the batch: its stored copy goes, then it is freed. A copy that cannot be
        deleted only means the batch may be offered again after a restart."""
        batch = self.buffer.get(batch_id)
        await self._storage.batch_acknowledged(batch_id)
        if batch_id in self.buffer:
            batch = self.buffer.acknowledge(batch_id)
        else:
            self.buffer.get(batch_id)  # acknowledged meanwhile: the 410 of a second acknowledgement
        return batch

    async def sweep(self) -> int:
        """Give every batch past its TTL to the storage and free it; returns how many were freed. A
        batch the storage could not write stays (still readable and acknowledgeable); the next sweep
        retries."""
        expired = self.buffer.expired(time.monotonic())
        freed = 0
        for batch in expired:
            message = await self._storage.expire_batch(batch, self.ttl_s)
            if message is None:
                batch.writing = False
                continue
            self.buffer.release(batch, ErrorCode.BATCH_EXPIRED, message)
            freed += 1
        return freed

    async def quiesce(self) -> None:
        """Wait for batches being built (the drain calls this once exports are refused): a batch
        finished after the drain wrote the buffer, or a session put back after a failed build, would
        be missed."""
        await self._none_building.wait()

    def release_for_shutdown(self) -> None:
        """Free every held batch as the storage says (kept for the next process, or dropped)."""
        batches = list(self.buffer)
        departure = self._storage.drain_batches(batches)
        for batch in batches:
            self.buffer.release(batch, ErrorCode.DRAINING, departure.reason, remember=not departure.lives_on)

    async def restore(self) -> int:
        """Bring back the batches a predecessor held, with a fresh TTL."""
        batches = await self._storage.restore_batches(self.ttl_s)
        for batch in batches:
            self.buffer.add(batch)
        return len(batches)
