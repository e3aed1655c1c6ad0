"""Images stored once per proxy, by the sha256 of their bytes.

With a dump directory each distinct image is one file, `images/<sha256>.<png|jpg|webp>`, written and
fsynced (as the journal is) before the turn that brought it is answered; sessions, the journal and
snapshots name images by digest only. Without one (dropping sessions was chosen) the bytes are held
in memory instead, once each. Either way an image leaves when nothing references it: no session held
(live or being written), no request in flight (pinned), and no export batch not yet acknowledged
(`collect`, in a worker thread of the cleanup cycle, given what held references when it started).

At start the files a predecessor left are trusted by name (their headers read, not their bytes
hashed: a restart costs no pass over gigabytes of screenshots); each is verified when first used:
a request that brings the image again rewrites the file from its bytes, and an export reading it
checks its sha256.

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
from array import array
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Sequence
from pathlib import Path
from typing import TypeAlias

from rolloutfleet_wire.session_record import DIGEST_BYTES

from ..images import ImageInfo
from .dumps import write_atomic

log = logging.getLogger("rolloutfleet.proxy")

IMAGES_AREA = "images"
# What references images: a session's digest array (DIGEST_BYTES each), or a batch's set of digests.
ImageHolder: TypeAlias = "array[int] | frozenset[bytes]"
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
        # Files a predecessor left, trusted by name until their bytes are seen (see the module doc).
        self._unverified: set[bytes] = set()
        # A counter of pins and unpins, and the count at each digest's latest: an image touched after
        # a collection took its snapshot of references may be referenced by a turn recorded since.
        self._epoch = 0
        self._touched: dict[bytes, int] = {}
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
        """Keep `digest` while a request uses it; its info when the image is already held (and its
        file verified: an unverified one is `put` again from the request's bytes)."""
        with self._lock:
            self._pins[digest] += 1
            self._epoch += 1
            self._touched[digest] = self._epoch
            return None if digest in self._unverified else self._index.get(digest)

    def unpin(self, digests: Iterable[bytes]) -> None:
        with self._lock:
            self._epoch += 1
            for digest in digests:
                self._touched[digest] = self._epoch
                self._pins[digest] -= 1
                if self._pins[digest] <= 0:
                    del self._pins[digest]

    def put(self, info: ImageInfo, data: bytes) -> None:
        """Keep a pinned image's bytes (durable before this returns, with a directory)."""
        if self._dir is not None:
            write_atomic(self.path(info), data)
        with self._lock:
            self._unverified.discard(info.digest)
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
        """The whole image (blocking: exports); ValueError when a file left by a predecessor does not
        hold the bytes its name says."""
        info = self.info(digest)
        if self._dir is None:
            return self._memory[digest]
        data = self.path(info).read_bytes()
        with self._lock:
            unverified = digest in self._unverified
        if unverified:
            if hashlib.sha256(data).digest() != digest:
                raise ValueError(f"image file {self.path(info)} does not hold the bytes its name says")
            with self._lock:
                self._unverified.discard(digest)
        return data

    # --- start and cleanup ------------------------------------------------------------------------

    def load(self) -> int:
        """The images a predecessor left (blocking, at start, before any request), trusted by name:
        each file's header is read (format and size), its bytes are not hashed (verified on first use,
        see the module doc). A file whose name or header is not an image's is set aside (`corrupt/`)."""
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
                if len(digest) != DIGEST_BYTES:
                    raise ValueError("its name is not a sha256")
                info = _file_info(path, digest)
            except Exception as exc:  # Pillow raises many kinds for a file that is not an image
                log.error("image file %s cannot be used (%s); moved to corrupt/", path, exc)
                corrupt = self._dir.parent / "corrupt"
                corrupt.mkdir(exist_ok=True)
                os.replace(path, corrupt / path.name)
                continue
            self._index[digest] = info
            self._unverified.add(digest)
            self.bytes += info.size
        return len(self._index)

    def epoch(self) -> int:
        """Taken with the snapshot of references a collection works from (`collect`)."""
        with self._lock:
            return self._epoch

    def collect(self, holders: Sequence[ImageHolder], since: int) -> list[ImageInfo]:
        """Blocking (a worker thread): forget and delete the images none of `holders` (each session's
        digest array, each unacknowledged batch's digests, taken on the loop at epoch `since`)
        references and no request has pinned or released since."""
        gone = self.unreferenced(referenced_digests(holders), since)
        self.delete_files(gone)
        return gone

    def unreferenced(self, referenced: set[bytes], since: int) -> list[ImageInfo]:
        """Forget the images nothing referenced at epoch `since` and no request has pinned or
        released since; their bytes go next."""
        with self._lock:
            gone = [
                info
                for digest, info in self._index.items()
                if digest not in referenced
                and digest not in self._pins
                and self._touched.get(digest, -1) <= since
            ]
            for info in gone:
                del self._index[info.digest]
                self._memory.pop(info.digest, None)
                self._unverified.discard(info.digest)
                self.bytes -= info.size
            # What was touched before the snapshot matters to no later collection (their snapshots
            # are newer): keep the table to the images touched since.
            self._touched = {d: e for d, e in self._touched.items() if e > since}
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


def _file_info(path: Path, digest: bytes) -> ImageInfo:
    """An image file's info from its header (Pillow reads no pixels) and its size: what a restart
    trusts of a file this proxy wrote after checking its bytes."""
    from PIL import Image

    with Image.open(path) as image:
        name = (image.format or "").lower()
        width, height = image.size
    if ImageInfo(digest, name, width, height, 0).suffix != path.name.partition(".")[2]:
        raise ValueError(f"its header says {name or 'no image format'}, its name {path.suffix}")
    return ImageInfo(digest, name, width, height, path.stat().st_size)


def referenced_digests(holders: Sequence[ImageHolder]) -> set[bytes]:
    """Every digest the holders name: digest arrays (DIGEST_BYTES each, back to back) and sets."""
    referenced: set[bytes] = set()
    for holder in holders:
        if isinstance(holder, frozenset):
            referenced |= holder
            continue
        data = holder.tobytes()  # one call: a consistent copy even while the loop appends to it
        referenced.update(data[i : i + DIGEST_BYTES] for i in range(0, len(data), DIGEST_BYTES))
    return referenced
