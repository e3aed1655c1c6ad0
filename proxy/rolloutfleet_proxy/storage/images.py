"""Images stored once per proxy, by the sha256 of their bytes.

With a dump directory each distinct image is one file, `images/<sha256>.<png|jpg|webp>`, written and
fsynced (as the journal is) before the turn that brought it is answered; sessions, the journal and
snapshots name images by digest only. Without one (dropping sessions was chosen) the bytes are held
in memory instead, once each. Either way an image leaves when nothing references it: no session held
(live or being written), no request in flight (pinned), and no export batch not yet acknowledged
(`collect`, in the cleanup cycle, given the referenced digests).

The store is used from worker threads (a request's images are decoded off the event loop) and from
the loop: its index and pins are guarded by a lock; file I/O runs outside it.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import os
import threading
from collections import Counter
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

from ..images import ImageInfo, inspect
from .dumps import write_atomic

log = logging.getLogger("rolloutfleet.proxy")

IMAGES_AREA = "images"
# Read and base64-encoded piece by piece when sent upstream: a multiple of 3 bytes, so the pieces'
# encodings concatenate into the whole file's.
CHUNK_BYTES = 3 * 256 * 1024


class ImageStore:
    """The index (digest -> ImageInfo), pins of requests in flight, and the bytes (files or memory)."""

    def __init__(self, directory: Path | None):
        self._dir = directory
        self._lock = threading.Lock()
        self._index: dict[bytes, ImageInfo] = {}
        self._pins: Counter[bytes] = Counter()
        self._memory: dict[bytes, bytes] = {}  # without a directory
        self.bytes = 0  # of every image held
        self.writes = 0

    @property
    def in_memory(self) -> bool:
        return self._dir is None

    def __len__(self) -> int:
        return len(self._index)

    def path(self, info: ImageInfo) -> Path:
        assert self._dir is not None
        return self._dir / f"{info.digest.hex()}.{info.suffix}"

    # --- a request's images (blocking: worker threads) ---------------------------------------------

    def pin(self, digest: bytes) -> ImageInfo | None:
        """Keep `digest` while a request uses it; its info when the image is already held."""
        with self._lock:
            self._pins[digest] += 1
            return self._index.get(digest)

    def unpin(self, digests: Iterable[bytes]) -> None:
        with self._lock:
            for digest in digests:
                self._pins[digest] -= 1
                if self._pins[digest] <= 0:
                    del self._pins[digest]

    def put(self, info: ImageInfo, data: bytes) -> None:
        """Keep a pinned image's bytes (durable before this returns, with a directory)."""
        if self._dir is not None:
            write_atomic(self.path(info), data)
        with self._lock:
            if info.digest in self._index:
                return
            if self._dir is None:
                self._memory[info.digest] = data
            self._index[info.digest] = info
            self.bytes += info.size
            self.writes += 1

    def info(self, digest: bytes) -> ImageInfo:
        with self._lock:
            return self._index[digest]

    def held(self, digest: bytes) -> bool:
        with self._lock:
            return digest in self._index

    # --- the engine's copy ------------------------------------------------------------------------

    async def base64_chunks(self, digest: bytes) -> AsyncIterator[bytes]:
        """The image's bytes in base64, a piece at a time (one piece in memory, read off the loop)."""
        info = self.info(digest)
        if self._dir is None:
            data = self._memory[digest]
            for start in range(0, len(data), CHUNK_BYTES):
                yield base64.b64encode(data[start : start + CHUNK_BYTES])
            return
        handle = await asyncio.to_thread(open, self.path(info), "rb")
        try:
            while True:
                piece = await asyncio.to_thread(handle.read, CHUNK_BYTES)
                if not piece:
                    return
                yield base64.b64encode(piece)
        finally:
            handle.close()

    def read(self, digest: bytes) -> bytes:
        """The whole image (blocking: exports, stale dumps)."""
        info = self.info(digest)
        if self._dir is None:
            return self._memory[digest]
        return self.path(info).read_bytes()

    # --- start and cleanup ------------------------------------------------------------------------

    def load(self) -> int:
        """The images a predecessor left (blocking, at start, before any request). A file whose bytes
        do not match its name is set aside (`corrupt/`)."""
        if self._dir is None:
            return 0
        self._dir.mkdir(parents=True, exist_ok=True)
        for path in self._dir.iterdir():
            name, _, suffix = path.name.partition(".")
            if path.name.startswith(".") or not suffix:
                path.unlink(missing_ok=True)  # a write a crash cut short
                continue
            try:
                digest = bytes.fromhex(name)
                data = path.read_bytes()
                if hashlib.sha256(data).digest() != digest:
                    raise ValueError("its bytes do not match its name")
                info = inspect(data, digest, frozenset({"jpeg" if suffix == "jpg" else suffix}))
            except Exception as exc:
                log.error("image file %s cannot be used (%s); moved to corrupt/", path, exc)
                corrupt = self._dir.parent / "corrupt"
                corrupt.mkdir(exist_ok=True)
                os.replace(path, corrupt / path.name)
                continue
            self._index[digest] = info
            self.bytes += info.size
        return len(self._index)

    def unreferenced(self, referenced: set[bytes]) -> list[ImageInfo]:
        """Forget the images nothing references (and no request has pinned); their bytes go next."""
        with self._lock:
            gone = [
                info
                for digest, info in self._index.items()
                if digest not in referenced and digest not in self._pins
            ]
            for info in gone:
                del self._index[info.digest]
                self._memory.pop(info.digest, None)
                self.bytes -= info.size
        return gone

    def delete_files(self, gone: list[ImageInfo]) -> None:
        """Blocking: delete the files of images `unreferenced` returned."""
        if self._dir is None:
            return
        for info in gone:
            try:
                self.path(info).unlink(missing_ok=True)
            except OSError as exc:
                log.error("cannot delete image file %s: %s", self.path(info), exc)
