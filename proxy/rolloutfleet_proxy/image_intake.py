"""A request's images: decoded, checked and stored once, off the event loop, before its turn runs.

Every image part of the request (the history's too: the digest is what history matching compares)
is decoded from base64 one at a time, named by the sha256 of its bytes and pinned for the request.
An image the proxy already holds costs only that; a new one has its header read (format, size,
integrity) and is written (fsynced) to the image store. Its part then holds the digest, and its
base64 is released: a request holds its body's text, plus one decoded image at a time.

Refusals (400, nothing recorded, nothing pinned left behind): broken base64 or an unreadable image
`invalid_image`, a format not allowed `invalid_image`, over the size limits `image_too_large`, an
http(s) URL while fetching is off, or any image for a model directory without images,
`unsupported_content`.
"""

from __future__ import annotations

import asyncio
import urllib.request
from dataclasses import dataclass, field

from rolloutfleet_wire.errors import ErrorCode

from .failures import ImageNotTaken
from .history import image_parts
from .images import ImageLimits, ImageRefused, ImageSource, decode_source, digest_of, inspect, is_remote
from .openai_format import ChatRequest
from .stats import Counters
from .storage.images import ImageStore
from .vision import VisionModel

FETCH_TIMEOUT_S = 30.0
_CODES = {
    "invalid": ErrorCode.INVALID_IMAGE,
    "too_large": ErrorCode.IMAGE_TOO_LARGE,
    "unsupported": ErrorCode.UNSUPPORTED_CONTENT,
}


@dataclass
class Pinned:
    """The digests a request pinned (unpinned once its turn is recorded or failed)."""

    digests: list[bytes] = field(default_factory=list)


class ImageIntake:
    def __init__(
        self, store: ImageStore, limits: ImageLimits, vision: VisionModel | None, counters: Counters
    ):
        self.store = store
        self.limits = limits
        self.vision = vision
        self._counters = counters

    def has_images(self, request: ChatRequest) -> bool:
        return next(image_parts(request.messages), None) is not None

    async def take(self, request: ChatRequest) -> Pinned:
        """Resolve the request's image parts in place (source -> sha256 hex); the caller `release`s
        the returned pins after the turn."""
        pinned = Pinned()
        parts = list(image_parts(request.messages))
        if not parts:
            return pinned
        if self.vision is None:
            raise ImageNotTaken(
                ErrorCode.UNSUPPORTED_CONTENT,
                "this proxy's model takes no images (its model directory has no preprocessor_config.json)",
            )
        try:
            await asyncio.to_thread(self._resolve, parts, pinned)
        except BaseException:
            self.release(pinned)
            raise
        return pinned

    def release(self, pinned: Pinned) -> None:
        self.store.unpin(pinned.digests)
        pinned.digests.clear()

    def _resolve(self, parts: list[dict], pinned: Pinned) -> None:
        """Blocking (a worker thread): each part's bytes decoded, named, checked and stored."""
        limits = self.limits
        total = 0
        for index, part in enumerate(parts):
            source = part["image"]
            assert isinstance(source, ImageSource)
            try:
                data = self._bytes_of(source.take())
                total += len(data)
                if total > limits.max_request_image_bytes:
                    raise ImageRefused(
                        "too_large",
                        f"the request's images hold more than {limits.max_request_image_bytes} bytes "
                        "(max_request_image_bytes)",
                    )
                digest = digest_of(data)
                pinned.digests.append(digest)
                if self.store.pin(digest) is None:
                    info = inspect(data, digest, limits.formats)
                    self.store.put(info, data)
                    self._counters.images_stored += 1
                    self._counters.image_bytes_stored += info.size
            except ImageRefused as exc:
                raise ImageNotTaken(
                    _CODES[exc.kind], f"image {index} of the request: {exc.message}"
                ) from None
            del data
            part["image"] = digest.hex()
        self._counters.images_received += len(parts)

    def _bytes_of(self, url: str) -> bytes:
        if not is_remote(url):
            return decode_source(url, self.limits.max_image_bytes)
        if not self.limits.fetch_urls:
            raise ImageRefused(
                "unsupported",
                "http(s) image URLs are not fetched (a rollout must be reproducible): send the image as a "
                "data URI or base64, or start the proxy with --fetch-image-urls",
            )
        limit = self.limits.max_image_bytes
        try:
            with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as answer:
                data = answer.read(limit + 1)
        except OSError as exc:
            raise ImageRefused("invalid", f"the image URL could not be fetched ({exc})") from None
        if len(data) > limit:
            raise ImageRefused("too_large", f"an image holds more than {limit} bytes (max_image_bytes)")
        return data
