"""Exported batches held in memory until the trainer acknowledges them, and what became of the rest.

Synchronous, so every method runs atomically on the event loop. A batch leaves in exactly one way:
acknowledged (freed), expired (written to `exported/`, then freed), drained (written to
`live-exports/` at shutdown) or dropped (only without a dump directory, when dropping was chosen).
Its id is then remembered (bounded), so a late call learns which of these happened.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

from rolloutfleet_wire.errors import ErrorCode

from .failures import BatchEnded, UnknownBatch


@dataclass(eq=False)
class ExportBatch:
    batch_id: str
    data: bytes  # the safetensors bytes, served as they are on every request for this id
    session_ids: list[str]
    num_tokens: int
    created_at: float  # Unix seconds
    expires_at: float  # monotonic deadline for the acknowledgement
    writing: bool = field(default=False)  # being written to disk after its TTL ran out
    # The images its samples hold: kept in the image store until the batch is acknowledged.
    image_digests: frozenset[bytes] = field(default_factory=frozenset)
    acknowledged: bool = field(default=False)

    @property
    def num_trajectories(self) -> int:
        return len(self.session_ids)

    def summary(self, now: float) -> dict:
        return {
            "batch_id": self.batch_id,
            "trajectories": self.num_trajectories,
            "tokens": self.num_tokens,
            "bytes": len(self.data),
            "created_at": self.created_at,
            "expires_in_seconds": round(max(0.0, self.expires_at - now), 3),
            "session_ids": self.session_ids,
        }


class ExportBuffer:
    def __init__(self, ended_capacity: int = 10000):
        self._batches: dict[str, ExportBatch] = {}
        self._ended: OrderedDict[str, tuple[ErrorCode, str]] = OrderedDict()  # id -> (how it left, message)
        self._ended_capacity = ended_capacity
        self.bytes = 0
        self.trajectories = 0

    def __len__(self) -> int:
        return len(self._batches)

    def __iter__(self) -> Iterator[ExportBatch]:
        return iter(list(self._batches.values()))

    def __contains__(self, batch_id: str) -> bool:
        return batch_id in self._batches

    def add(self, batch: ExportBatch) -> None:
        if batch.batch_id in self._batches:
            raise ValueError(f"batch {batch.batch_id} is already held")
        self._ended.pop(batch.batch_id, None)
        self._batches[batch.batch_id] = batch
        self.bytes += len(batch.data)
        self.trajectories += batch.num_trajectories

    def get(self, batch_id: str) -> ExportBatch:
        """The held batch, or the failure for an id that is not held (any more)."""
        batch = self._batches.get(batch_id)
        if batch is not None:
            return batch
        ended = self._ended.get(batch_id)
        if ended is not None:
            raise BatchEnded(batch_id, *ended)
        raise UnknownBatch(batch_id)

    def acknowledge(self, batch_id: str) -> ExportBatch:
        """Free a batch the trainer has. A second acknowledgement gets `batch_already_acknowledged`."""
        batch = self.get(batch_id)
        # Acknowledged while its TTL dump is being written: the dump's file is removed afterwards.
        batch.acknowledged = True
        self.release(
            batch, ErrorCode.BATCH_ALREADY_ACKNOWLEDGED, f"export batch {batch_id} was already acknowledged"
        )
        return batch

    def expired(self, now: float) -> list[ExportBatch]:
        """Batches past their deadline, marked as being written (they stay readable meanwhile)."""
        due = [b for b in self._batches.values() if not b.writing and b.expires_at <= now]
        for batch in due:
            batch.writing = True
        return due

    def release(self, batch: ExportBatch, code: ErrorCode, message: str, remember: bool = True) -> None:
        """Forget a batch's bytes; later calls for its id get `BatchEnded` with `code` (when remembered)."""
        if self._batches.pop(batch.batch_id, None) is None:
            return
        self.bytes -= len(batch.data)
        self.trajectories -= batch.num_trajectories
        batch.data = b""  # our last reference: the memory goes back now, not when the object dies
        if remember and self._ended_capacity:
            self._ended[batch.batch_id] = (code, message)
            self._ended.move_to_end(batch.batch_id)
            while len(self._ended) > self._ended_capacity:
                self._ended.popitem(last=False)


def new_batch(
    batch_id: str,
    data: bytes,
    session_ids: list[str],
    num_tokens: int,
    ttl_s: float,
    image_digests: frozenset[bytes] = frozenset(),
) -> ExportBatch:
    return ExportBatch(
        batch_id,
        data,
        session_ids,
        num_tokens,
        time.time(),
        time.monotonic() + ttl_s,
        image_digests=image_digests,
    )
