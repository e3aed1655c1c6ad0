"""Image parts of chat messages: what a client may send, and its bytes checked (pure functions).

An OpenAI `image_url` part carries a data URI (`data:image/png;base64,...`) or bare base64; an
http(s) URL only when fetching is allowed (a rollout must be reproducible, so by default the proxy
never fetches). The bytes are named by their sha256: the session records digests, never bytes.
Decoding reads only what names the image: its format and size from the header (Pillow), checked
for integrity without decoding pixels. Video, audio and file parts are refused (SGLang's Qwen-VL
processors take video, but a trainer cannot rebuild its frames from a proxy record yet).

Decoding costs CPU (base64, sha256, the header): callers run it in a worker thread.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import warnings
from dataclasses import dataclass

# Pillow names formats in upper case; the settings (allowed formats) list them in lower case.
KNOWN_FORMATS = frozenset({"png", "jpeg", "webp", "gif", "bmp", "tiff"})
DEFAULT_FORMATS = ("png", "jpeg", "webp")
# Parts that carry media the proxy does not take, by OpenAI's and SGLang's type names.
UNSUPPORTED_PARTS = frozenset(
    {"video_url", "video", "input_audio", "audio_url", "audio", "file", "input_file"}
)
DETAILS = frozenset({"auto", "low", "high"})
# Pillow's own guard against decompression bombs (its MAX_IMAGE_PIXELS): an image larger than this
# decodes to gigabytes on the engine whatever its file size.
MAX_IMAGE_PIXELS = 89_478_485
_FORMAT_SUFFIX = {"jpeg": "jpg"}


class ImageRefused(ValueError):
    """An image the proxy will not take; `kind` says why: "invalid" (400 invalid_image), "too_large"
    (400 image_too_large) or "unsupported" (400 unsupported_content)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message


@dataclass(frozen=True)
class ImageLimits:
    max_image_bytes: int = 8 * 1024 * 1024  # decoded, per image
    max_request_image_bytes: int = 32 * 1024 * 1024  # decoded, every image of one request
    formats: frozenset[str] = frozenset(DEFAULT_FORMATS)
    fetch_urls: bool = False


@dataclass(frozen=True)
class ImageInfo:
    """What the proxy keeps about an image: its name, format and size (the bytes are on disk)."""

    digest: bytes  # sha256 of the bytes
    format: str  # lower-case Pillow format name
    width: int
    height: int
    size: int  # bytes

    @property
    def suffix(self) -> str:
        return _FORMAT_SUFFIX.get(self.format, self.format)

    @property
    def media_type(self) -> str:
        return f"image/{self.format}"


class ImageSource:
    """An image part as sent, until its bytes are decoded: then the text is released (`take`), so a
    request holds each image's base64 only until it is on disk."""

    __slots__ = ("_url",)

    def __init__(self, url: str):
        self._url: str | None = url

    def take(self) -> str:
        url, self._url = self._url, None
        if url is None:
            raise RuntimeError("an image source is decoded once")
        return url

    def __repr__(self) -> str:
        return "ImageSource(...)" if self._url is not None else "ImageSource(taken)"


def image_part_source(part: dict, where: str) -> ImageSource:
    """The source of an `image_url` part: `{"type": "image_url", "image_url": {"url", "detail"}}`
    (a bare string as `image_url` is taken too); ValueError naming what is wrong."""
    image_url = part.get("image_url")
    url: object
    detail: object
    if isinstance(image_url, str):
        url, detail = image_url, None
    elif isinstance(image_url, dict):
        url, detail = image_url.get("url"), image_url.get("detail")
    else:
        raise ValueError(f"{where}: image_url must be an object with a url")
    if not isinstance(url, str) or not url:
        raise ValueError(f"{where}: image_url.url must be a non-empty string")
    if detail is not None and detail not in DETAILS:
        raise ValueError(f"{where}: image_url.detail must be one of {sorted(DETAILS)}")
    return ImageSource(url)


def is_remote(url: str) -> bool:
    head = url[:8].lower()
    return head.startswith("http://") or head.startswith("https://")


def decode_source(url: str, max_bytes: int) -> bytes:
    """The bytes of a data URI or bare base64 (not of a remote URL: see `is_remote`)."""
    if url[:5].lower() == "data:":
        header, comma, payload = url.partition(",")
        if not comma or not header.lower().endswith(";base64"):
            raise ImageRefused("invalid", "an image data URI must be data:<media type>;base64,<data>")
        media = header[5 : -len(";base64")].lower()
        if media and not media.startswith("image/"):
            raise ImageRefused(
                "unsupported", f"a {media} data URI is not an image (video and audio are refused)"
            )
    elif "://" in url[:16]:
        scheme = url.split("://", 1)[0]
        raise ImageRefused("invalid", f"{scheme} URLs are not taken: send the image as a data URI or base64")
    else:
        payload = url
    # Three bytes per four characters: refuse what cannot fit before decoding anything.
    if len(payload) // 4 * 3 - 2 > max_bytes:
        raise ImageRefused("too_large", f"an image holds more than {max_bytes} bytes (max_image_bytes)")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageRefused("invalid", "an image is not valid base64") from None
    if len(data) > max_bytes:
        raise ImageRefused(
            "too_large", f"an image holds {len(data)} bytes; the most is {max_bytes} (max_image_bytes)"
        )
    return data


def digest_of(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def inspect(data: bytes, digest: bytes, formats: frozenset[str]) -> ImageInfo:
    """Format and size from the image's header, its integrity checked without decoding pixels."""
    from PIL import Image  # only where images arrive

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                name = (image.format or "").lower()
                width, height = image.size
                frames = getattr(image, "n_frames", 1)
                image.verify()
    except (Image.DecompressionBombWarning, Image.DecompressionBombError):
        raise ImageRefused("too_large", f"an image has more than {MAX_IMAGE_PIXELS} pixels") from None
    except Exception as exc:  # Pillow raises many kinds for bytes that are not an image
        raise ImageRefused("invalid", f"an image could not be read ({type(exc).__name__}: {exc})") from None
    if name not in formats:
        allowed = ", ".join(sorted(formats))
        raise ImageRefused("invalid", f"image format {name or 'unknown'} is not taken (allowed: {allowed})")
    if frames != 1:
        raise ImageRefused("unsupported", f"an animated image ({frames} frames) is video; it is refused")
    if width < 1 or height < 1 or width * height > MAX_IMAGE_PIXELS:
        raise ImageRefused("too_large", f"an image of {width}x{height} pixels is not taken")
    return ImageInfo(digest, name, width, height, len(data))
