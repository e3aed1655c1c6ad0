"""Routing replay's rows of expert ids, kept out of memory: one append-only file per session.

A token's routing is 40-60 times its id, logprob and mask (48 layers x 8 experts in a byte each,
against 9 bytes), and a session waits idle between turns far longer than a turn takes: so rows go to
`routing/<session id>.<incarnation>.r3` on the dump volume as their turn is recorded, and are read
back only to export. A file is a 16-byte header (`RFR3`, then layers, top-k and the expert count as
little-endian u32) and the session's rows in recording order (routed_experts.row_offsets), in the
smallest unsigned type that holds the expert count.

Durability comes from the journal, which holds every turn's rows with its tokens: a file is appended
to without a sync, synced before the journal segments that hold its rows are retired (compaction,
the drain) and rebuilt from the journal at start (`restore_routing`). Without a dump directory the
rows stay in memory (`RoutingMemory`), like everything else then.

Files of sessions no longer held are deleted by `collect` (a cleanup cycle, after the sessions'
departures were journaled) and at start; stale sessions' files are linked beside their dumps first.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from rolloutfleet_wire.routed_experts import RoutingError, RoutingShape, row_offsets
from rolloutfleet_wire.session_record import SessionRecord

ROUTING_AREA = "routing"
SUFFIX = ".r3"
MAGIC = b"RFR3"
_HEADER = struct.Struct("<4sIII")  # magic, layers, top_k, experts
HEADER_BYTES = _HEADER.size


def routing_key(session_id: str, key_digest: bytes) -> str:
    """A session's name in the store: its id and incarnation (a later session reusing the id is
    another file)."""
    return f"{session_id}.{key_digest[:8].hex()}"


def record_key(record: SessionRecord) -> str:
    return routing_key(record.session_id, record.key_digest)


def header(shape: RoutingShape) -> bytes:
    return _HEADER.pack(MAGIC, shape.layers, shape.top_k, shape.experts)


def read_header(data: bytes) -> RoutingShape:
    if len(data) < HEADER_BYTES:
        raise RoutingError("routing file shorter than its header")
    magic, layers, top_k, experts = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise RoutingError("not a routing file")
    return RoutingShape(layers, top_k, experts)


def expected_bytes(record: SessionRecord, shape: RoutingShape) -> int:
    """The bytes of rows a session's record says its routing holds."""
    return row_offsets(record)[-1] * shape.row_bytes


def routing_problem(record: SessionRecord, shape: RoutingShape, rows: bytes) -> str | None:
    """Why `rows` are not the routing a record's turns stored (lengths and CRC-32s), or None."""
    offsets = row_offsets(record)
    if len(rows) != offsets[-1] * shape.row_bytes:
        return (
            f"its routing holds {len(rows)} bytes, not the {offsets[-1] * shape.row_bytes} its turns stored"
        )
    for turn, routed in enumerate(record.turn_routed):
        if routed:
            part = rows[offsets[turn] * shape.row_bytes : offsets[turn + 1] * shape.row_bytes]
            if zlib.crc32(part) != record.turn_routing_crcs[turn]:
                return f"the routing of turn {turn} fails its checksum"
    return None


class RoutingStore(ABC):
    """Where the rows of routed turns are, by session key. `shape` is the fleet's (None: routing
    replay is off; rows restored from before are still read back and exported)."""

    shape: RoutingShape | None

    @abstractmethod
    def size(self, key: str) -> int:
        """Bytes of rows held for a session."""

    @abstractmethod
    async def append(self, key: str, rows: bytes) -> None:
        """Add a turn's rows (before the turn is appended in memory and journaled)."""

    @abstractmethod
    async def truncate(self, key: str, size: int) -> None:
        """Back to `size` bytes (a turn that could not be made durable)."""

    @abstractmethod
    def read(self, key: str) -> bytes:
        """A session's rows (blocking: an export's worker thread); RoutingError when unreadable."""

    @abstractmethod
    def forget(self, held: set[str]) -> list[str]:
        """On the loop: stop holding every session not in `held`; returns their keys for `delete`."""

    @abstractmethod
    def delete(self, keys: list[str]) -> None:
        """Blocking: remove what `forget` returned."""

    def sync(self, keys: Iterable[str]) -> None:  # noqa: B027 (memory: nothing to sync)
        """Blocking: make the sessions' rows durable (before the journal holding them is retired)."""

    def link_into(self, keys: Iterable[str], directory: Path) -> None:  # noqa: B027
        """Blocking: keep the sessions' rows beside their stale dumps."""

    async def collect(self, held: set[str]) -> int:
        """Delete the rows of sessions no longer held; returns how many sessions' rows left."""
        gone = self.forget(held)
        if gone:
            await asyncio.to_thread(self.delete, gone)
        return len(gone)


class RoutingMemory(RoutingStore):
    """Rows in memory (no dump directory)."""

    def __init__(self, shape: RoutingShape | None = None):
        self.shape = shape
        self._rows: dict[str, bytearray] = {}

    def size(self, key: str) -> int:
        rows = self._rows.get(key)
        return 0 if rows is None else len(rows)

    async def append(self, key: str, rows: bytes) -> None:
        self._rows.setdefault(key, bytearray()).extend(rows)

    async def truncate(self, key: str, size: int) -> None:
        if key in self._rows:
            del self._rows[key][size:]

    def read(self, key: str) -> bytes:
        return bytes(self._rows.get(key, b""))

    def forget(self, held: set[str]) -> list[str]:
        gone = [key for key in self._rows if key not in held]
        for key in gone:
            del self._rows[key]
        return gone

    def delete(self, keys: list[str]) -> None:
        pass


class RoutingFiles(RoutingStore):
    """One file per session under `directory`. `failed` turns an OSError into the Failure the caller
    raises (the storage's `storage_unavailable`)."""

    def __init__(
        self, directory: Path, failed: Callable[[OSError], Exception], shape: RoutingShape | None = None
    ):
        self.directory = directory
        self.shape = shape
        self._failed = failed
        self._sizes: dict[str, int] = {}  # rows held per session (the file is HEADER_BYTES more)
        self._unsynced: set[str] = set()

    def path(self, key: str) -> Path:
        return self.directory / (key + SUFFIX)

    def size(self, key: str) -> int:
        return self._sizes.get(key, 0)

    def keys(self) -> list[str]:
        return list(self._sizes)

    def adopt(self, sizes: dict[str, int]) -> None:
        """The sessions a restore rebuilt files for, and their rows' sizes."""
        self._sizes.update(sizes)

    async def append(self, key: str, rows: bytes) -> None:
        shape = self.shape
        if shape is None:
            raise RoutingError("routing replay is off: no rows to keep")
        fresh = key not in self._sizes
        size = self._sizes.get(key, 0)
        data = (header(shape) if fresh else b"") + rows
        try:
            await asyncio.to_thread(self._write_at, key, data, 0 if fresh else HEADER_BYTES + size, fresh)
        except OSError as exc:
            raise self._failed(exc) from None
        self._sizes[key] = size + len(rows)
        self._unsynced.add(key)

    def _write_at(self, key: str, data: bytes, offset: int, fresh: bool) -> None:
        """Blocking. At the offset the rows held end (not appended): a tail a failed turn left, that
        could not be cut back, is overwritten."""
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path(key), os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if fresh else 0), 0o600)
        try:
            view = memoryview(data)
            while view:
                written = os.pwrite(fd, view, offset)
                view, offset = view[written:], offset + written
        finally:
            os.close(fd)

    async def truncate(self, key: str, size: int) -> None:
        if key not in self._sizes or self._sizes[key] <= size:
            return
        self._sizes[key] = size  # the next turn's rows go there, whether or not the tail is cut
        with contextlib.suppress(OSError):
            await asyncio.to_thread(os.truncate, self.path(key), HEADER_BYTES + size)

    def read(self, key: str) -> bytes:
        size = self._sizes.get(key, 0)
        if not size:
            return b""
        with open(self.path(key), "rb") as f:
            data = f.read(HEADER_BYTES + size)
        if self.shape is not None and read_header(data) != self.shape:
            raise RoutingError(f"the routing of {key} is of another model ({read_header(data)})")
        if len(data) != HEADER_BYTES + size:
            raise RoutingError(f"the routing file of {key} is shorter than the rows recorded")
        return data[HEADER_BYTES:]

    def forget(self, held: set[str]) -> list[str]:
        gone = [key for key in self._sizes if key not in held]
        for key in gone:
            del self._sizes[key]
            self._unsynced.discard(key)
        return gone

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            self.path(key).unlink(missing_ok=True)

    def sync(self, keys: Iterable[str]) -> None:
        for key in [k for k in keys if k in self._unsynced]:
            fd = os.open(self.path(key), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            self._unsynced.discard(key)

    def link_into(self, keys: Iterable[str], directory: Path) -> None:
        keys = [k for k in keys if k in self._sizes]
        if not keys:
            return
        self.sync(keys)
        directory.mkdir(parents=True, exist_ok=True)
        for key in keys:
            target = directory / (key + SUFFIX)
            with contextlib.suppress(FileNotFoundError):
                target.unlink()
            os.link(self.path(key), target)
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# --- restore: the files rebuilt to hold exactly what the sessions restored say ----------------------


class RoutingRestore:
    """Used by the restore (blocking, in its worker thread): each snapshot's file cut back to the rows
    its turns stored (checked against their CRCs), each journaled turn's rows appended, and at the end
    every file checked against its session and synced; files of sessions not restored are removed."""

    def __init__(self, directory: Path, shape: RoutingShape | None):
        self.directory = directory
        self.shape = shape
        self.sizes: dict[str, int] = {}

    def _path(self, key: str) -> Path:
        return self.directory / (key + SUFFIX)

    def _file_shape(self, key: str) -> RoutingShape:
        with open(self._path(key), "rb") as f:
            return read_header(f.read(HEADER_BYTES))

    def from_snapshot(self, record: SessionRecord) -> str | None:
        """Cut a snapshot's file back to its turns' rows; why it cannot be, or None."""
        key = record_key(record)
        if not any(record.turn_routed):
            self.reset(key)
            return None
        try:
            data = self._path(key).read_bytes()
            shape = read_header(data)
        except (OSError, RoutingError) as exc:
            return f"its routing file cannot be read ({exc})"
        size = expected_bytes(record, shape)
        problem = routing_problem(record, shape, data[HEADER_BYTES : HEADER_BYTES + size])
        if problem:
            return problem
        if len(data) != HEADER_BYTES + size:
            os.truncate(self._path(key), HEADER_BYTES + size)
        self.sizes[key] = size
        return None

    def reset(self, key: str) -> None:
        """A session that starts here (its creation replayed, or a snapshot without routing)."""
        self._path(key).unlink(missing_ok=True)
        self.sizes.pop(key, None)

    def append(self, key: str, rows: bytes) -> None:
        """A journaled turn's rows."""
        fresh = key not in self.sizes
        if fresh and self.shape is None:
            raise RoutingError("a journaled turn has routing, but routing replay is off")
        self.directory.mkdir(parents=True, exist_ok=True)
        shape = self.shape if fresh else self._file_shape(key)
        assert shape is not None
        with open(self._path(key), "wb" if fresh else "ab") as f:
            if fresh:
                f.write(header(shape))
            f.write(rows)
        self.sizes[key] = self.sizes.get(key, 0) + len(rows)

    def finish(self, records: Mapping[str, SessionRecord]) -> dict[str, str]:
        """Check every restored session's file, sync it, and remove the others; returns the sessions
        (by id) whose routing does not add up, with why."""
        problems: dict[str, str] = {}
        keep = set()
        for session_id, record in records.items():
            key = record_key(record)
            if not any(record.turn_routed):
                continue
            keep.add(key)
            try:
                data = self._path(key).read_bytes()
                shape = read_header(data)
                if self.shape is not None and shape != self.shape:
                    raise RoutingError(f"its routing is of another model ({shape}, not {self.shape})")
            except (OSError, RoutingError) as exc:
                problems[session_id] = f"its routing cannot be read ({exc})"
                keep.discard(key)
                continue
            size = expected_bytes(record, shape)
            problem = routing_problem(record, shape, data[HEADER_BYTES : HEADER_BYTES + size])
            if problem:
                problems[session_id] = problem
                keep.discard(key)
                continue
            if len(data) > HEADER_BYTES + size:  # a tail a turn left that was never journaled
                os.truncate(self._path(key), HEADER_BYTES + size)
            self.sizes[key] = size
            fd = os.open(self._path(key), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        if self.directory.is_dir():
            for path in self.directory.iterdir():
                if path.name.endswith(SUFFIX) and path.name[: -len(SUFFIX)] not in keep:
                    path.unlink(missing_ok=True)
        self.sizes = {k: v for k, v in self.sizes.items() if k in keep}
        return problems


def drop_routing(directory: Path, records: Iterable[SessionRecord]) -> None:
    """Routing replay is off: the restored sessions' turns hold no rows any more, and their files go
    (blocking). Turned on again, later turns record rows and earlier ones stay without."""
    for record in records:
        for turn in range(len(record.turn_routed)):
            record.turn_routed[turn] = 0
            record.turn_routing_crcs[turn] = 0
    if directory.is_dir():
        for path in directory.iterdir():
            if path.name.endswith(SUFFIX):
                path.unlink(missing_ok=True)
