"""The write-ahead journal: every state change a client is told about is on disk before it is told.

Records (journal_records.py) are appended to numbered segment files `journal/<seq>.wal`. Appending is
synchronous (it only queues the bytes, in the order the changes were applied in memory); `commit`
waits until they are durable. One flusher writes everything queued with a single write and fdatasync
per round, in a worker thread: while one round syncs, the next accumulates (group commit), so the
cost of a sync is shared by every turn that finished meanwhile.

Durability `sync` (default): a reply waits for its record's sync. `async`: it does not; the flusher
syncs at least every `flush_interval_s`, so a crash loses at most that window of acknowledged
changes.

When a write fails the journal turns unavailable: queued commits fail with `storage_unavailable`, the
segment is cut back to its last intact record (or abandoned for a new one), and appends are refused
until the storage check (`health.StorageHealth`) finds the directory writable again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..failures import ShuttingDown
from .health import StorageHealth

JOURNAL_AREA = "journal"
SEGMENT_SUFFIX = ".wal"


def journal_dir(dump_dir: Path) -> Path:
    return dump_dir / JOURNAL_AREA


def segment_path(directory: Path, seq: int) -> Path:
    return directory / f"{seq:012d}{SEGMENT_SUFFIX}"


def list_segments(directory: Path) -> list[tuple[int, Path]]:
    """The journal's segments, oldest first (blocking)."""
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        stem = path.name[: -len(SEGMENT_SUFFIX)]
        if path.name.endswith(SEGMENT_SUFFIX) and stem.isdigit():
            found.append((int(stem), path))
    return sorted(found)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class _Pending:
    seq: int
    data: bytes
    future: asyncio.Future | None


@dataclass
class JournalStats:
    records: int = 0
    bytes_written: int = 0
    syncs: int = 0
    write_failures: int = 0
    segments_retired: int = 0
    commit_wait_s: float = 0.0  # summed over commits
    commits: int = 0
    sizes: dict[int, int] = field(default_factory=dict)  # bytes per open segment


class Journal:
    def __init__(
        self,
        directory: Path,
        health: StorageHealth,
        durability: str = "sync",
        flush_interval_s: float = 0.05,
    ):
        self.directory = directory
        self.health = health
        self.durability = durability
        self.flush_interval_s = flush_interval_s
        self.stats = JournalStats()
        self._seq = 0
        self._pending: list[_Pending] = []
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task | None = None
        self._fds: dict[int, int] = {}
        self._closed = False

    # --- life ---------------------------------------------------------------------------------

    async def open(self, after_seq: int) -> None:
        """Start appending to a new segment numbered after every existing one (a restarted proxy
        never appends to its predecessor's segments: their tails may be torn)."""
        self._seq = after_seq + 1
        await asyncio.to_thread(self.directory.mkdir, parents=True, exist_ok=True)
        for seq, path in await asyncio.to_thread(list_segments, self.directory):
            self.stats.sizes[seq] = (await asyncio.to_thread(path.stat)).st_size
        self._task = asyncio.create_task(self._flush_loop(), name="journal-flush")

    async def close(self) -> None:
        """Flush what is queued, then stop. Later appends are refused."""
        await self.flush()
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await asyncio.to_thread(self._close_fds, None)

    @property
    def segment_seq(self) -> int:
        return self._seq

    @property
    def total_bytes(self) -> int:
        return sum(self.stats.sizes.values())

    # --- appending ----------------------------------------------------------------------------

    def append(self, record: bytes) -> asyncio.Future | None:
        """Queue a record (the change it describes is already applied in memory). Returns what to pass
        to `commit`. Raises storage_unavailable when the journal cannot write."""
        if self._closed:
            raise ShuttingDown("the proxy is shutting down; nothing was recorded")
        if not self.health.ok:
            raise self.health.refuse("refused")
        future = asyncio.get_running_loop().create_future() if self.durability == "sync" else None
        self._pending.append(_Pending(self._seq, record, future))
        self.stats.records += 1
        self._idle.clear()
        self._wakeup.set()
        return future

    async def commit(self, future: asyncio.Future | None) -> None:
        """Wait until the record is durable (sync mode); raises storage_unavailable if it cannot be."""
        if future is None:
            return
        started = time.perf_counter()
        try:
            # Not shielded: a cancelled waiter (client gone) only cancels its own future; the record
            # stays queued and the flusher skips futures that are already done.
            await future
        finally:
            self.stats.commits += 1
            self.stats.commit_wait_s += time.perf_counter() - started

    async def write(self, record: bytes) -> None:
        await self.commit(self.append(record))

    async def flush(self) -> None:
        """Wait until everything queued so far has been written (or failed)."""
        if self._task is None:
            return
        while self._pending or not self._idle.is_set():
            await self._idle.wait()
            if self._pending:
                self._idle.clear()
                self._wakeup.set()

    def rotate(self) -> int:
        """Start a new segment: records appended from now on go there. Returns the last sequence number
        of the segments a compaction may retire once it has snapshotted every session."""
        retired_upto = self._seq
        self._seq += 1
        return retired_upto

    async def retire(self, upto_seq: int) -> int:
        """Delete segments up to `upto_seq` (their content is in snapshots now); returns how many."""
        await self.flush()
        removed = await asyncio.to_thread(self._retire, upto_seq)
        self.stats.segments_retired += removed
        return removed

    # --- the flusher --------------------------------------------------------------------------

    async def _flush_loop(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            if self.durability != "sync":
                await asyncio.sleep(self.flush_interval_s)
            batch, self._pending = self._pending, []
            if not batch:
                if not self._pending:
                    self._idle.set()
                continue
            try:
                await asyncio.to_thread(self._write_batch, batch)
            except OSError as exc:
                self.stats.write_failures += 1
                self.health.fail(f"journal write failed: {type(exc).__name__}: {exc}")
                error = self.health.refuse("not recorded")
                for item in batch:
                    if item.future is not None and not item.future.done():
                        item.future.set_exception(error)
            else:
                for item in batch:
                    if item.future is not None and not item.future.done():
                        item.future.set_result(None)
            if not self._pending:
                self._idle.set()

    def _write_batch(self, batch: list[_Pending]) -> None:
        """Blocking: append each segment's share with one write and one fdatasync."""
        by_seq: dict[int, list[bytes]] = {}
        for item in batch:
            by_seq.setdefault(item.seq, []).append(item.data)
        failure: OSError | None = None
        for seq, parts in by_seq.items():
            data = b"".join(parts)
            try:
                fd = self._fd(seq)
                good = self.stats.sizes.get(seq, 0)
                try:
                    _write_all(fd, data)
                    os.fdatasync(fd)
                except OSError:
                    self._cut_back(seq, fd, good)
                    raise
            except OSError as exc:
                failure = failure or exc
                continue
            self.stats.sizes[seq] = self.stats.sizes.get(seq, 0) + len(data)
            self.stats.bytes_written += len(data)
            self.stats.syncs += 1
        # Closed after every round: an open-for-write file pins its volume (no read-only remount, no
        # lazy unmount), and an open+close costs microseconds next to the fdatasync.
        self._close_fds(keep=None)
        if failure is not None:
            raise failure

    def _fd(self, seq: int) -> int:
        fd = self._fds.get(seq)
        if fd is None:
            path = segment_path(self.directory, seq)
            created = seq not in self.stats.sizes
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            self._fds[seq] = fd
            if created:
                fsync_dir(self.directory)  # the new segment's name is durable before anything in it counts
                self.stats.sizes.setdefault(seq, 0)
        return fd

    def _cut_back(self, seq: int, fd: int, good: int) -> None:
        """After a failed append, remove its partial bytes so later records follow intact ones; if even
        that fails, abandon the segment (later appends start a new one; the scan stops at the tear)."""
        try:
            os.ftruncate(fd, good)
            return
        except OSError:
            pass
        self._fds.pop(seq, None)
        os.close(fd)
        if seq == self._seq:
            self._seq += 1

    def _close_fds(self, keep: int | None) -> None:
        for seq in [s for s in self._fds if s != keep]:
            fd = self._fds.pop(seq, None)  # the retiring thread may have taken it meanwhile
            if fd is not None:
                os.close(fd)

    def _retire(self, upto_seq: int) -> int:
        removed = 0
        for seq, path in list_segments(self.directory):
            if seq > upto_seq:
                break
            fd = self._fds.pop(seq, None)
            if fd is not None:
                os.close(fd)
            path.unlink(missing_ok=True)
            self.stats.sizes.pop(seq, None)
            removed += 1
        if removed:
            fsync_dir(self.directory)
        return removed


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]
