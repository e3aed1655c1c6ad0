"""Where a chat request goes in its session's tree, and whether it was answered before (pure).

A request carries the whole conversation. Its messages are digested one by one (the canonical form
and chain of `history.py`, seeded with its tools); the deepest recorded turn whose reply ends a
prefix of them is the *base*: its recorded ids are reused token for token, and the messages after
that prefix are rendered there. No recorded reply in the prefix: the base is the root, and the
conversation is rendered from its start. A linear session's next turn is the common case: its base
is the latest turn.

A request equal to one answered before (same messages, tools, sampling parameters, `n` and template
keywords) is a retry: its recorded answer is sent again without calling the engine, unless the
client asked for a new sample (`regenerate`).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from rolloutfleet_wire import session_tree as tree
from rolloutfleet_wire.session_record import (
    DIGEST_BYTES,
    NO_DIGEST,
    ROOT,
    ImageSpan,
    SessionRecord,
    image_spans,
)

from .history import extend_canonical_digest


@dataclass(frozen=True)
class Placement:
    """Where a request's new messages start: after `base`'s reply, with `matched` messages reused."""

    base: int  # ROOT: nothing reused
    matched: int
    history_digest: bytes  # of all the request's messages
    request_digest: bytes


def message_digests(seed: bytes, messages: Sequence[Mapping[str, Any]]) -> list[bytes]:
    """The digest after each prefix of the messages: [seed, after 1, ..., after all]."""
    digests = [seed]
    for message in messages:
        digests.append(extend_canonical_digest(digests[-1], (message,)))
    return digests


def request_digest(history_digest: bytes, parameters: Mapping[str, Any]) -> bytes:
    """What makes two requests the same one: their whole history and every parameter that shapes
    the answer. Never all zeros (that means "not replayable" in a record)."""
    encoded = orjson.dumps(parameters, option=orjson.OPT_SORT_KEYS)
    digest = hashlib.blake2b(b"request\x00" + history_digest + encoded, digest_size=DIGEST_BYTES).digest()
    return digest if digest != NO_DIGEST else b"\x01" + digest[1:]


def place(
    record: SessionRecord, digests: list[bytes], parameters: Mapping[str, Any], base: int = ROOT
) -> Placement:
    """The deepest recorded reply the request's history runs through (the latest turn on a tie); none:
    `base` (the root, or the turn whose reply the messages are said to follow)."""
    ends: dict[bytes, int] = {}
    ends_bytes = record.turn_end_digests
    for turn in range(len(ends_bytes) // DIGEST_BYTES):
        digest = tree.digest_at(ends_bytes, turn)
        if digest != NO_DIGEST:
            ends[digest] = turn
    matched = 0
    for count in range(len(digests) - 1, 0, -1):
        found = ends.get(digests[count])
        if found is not None:
            base, matched = found, count
            break
    return Placement(base, matched, digests[-1], request_digest(digests[-1], parameters))


def shared_prefix(a: array, b: array) -> int:
    """The number of leading values two arrays share."""
    limit = min(len(a), len(b))
    if a[:limit] == b[:limit]:
        return limit
    low, high = 0, limit  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle
    return low


def attach(
    record: SessionRecord, base: int, new_ids: array, new_images: Sequence[ImageSpan] = ()
) -> tuple[int, int]:
    """The parent and kept length for new prompt ids rendered after `base`: the turn after `base`
    whose own prompt shares the longest start with them (a regeneration, a group, a compaction that
    kept the system prompt), so shared tokens are stored once; else `base` itself. Two images of the
    same size expand to the same ids: a shared start ends at the first image that is not the same
    image (`new_images`: offsets into `new_ids`)."""
    base_length = tree.path_length(record, base)
    parent, keep = base, base_length
    best = 0
    stored_images = image_spans(record) if record.image_spans else []
    for turn in range(tree.num_turns(record)):
        if record.turn_parents[turn] != base or record.turn_keeps[turn] != base_length:
            continue
        start, output_start, _ = tree.bounds(record, turn)
        shared = shared_prefix(record.token_ids[start:output_start], new_ids)
        if stored_images or new_images:
            own = [
                i._replace(offset=i.offset - start) for i in stored_images if start <= i.offset < output_start
            ]
            shared = _shared_before_other_images(shared, own, new_images)
        if shared > best:
            parent, keep, best = turn, base_length + shared, shared
    return parent, keep


def _shared_before_other_images(shared: int, stored: Sequence[ImageSpan], new: Sequence[ImageSpan]) -> int:
    """`shared` cut at the first image (of either side) that starts inside it and is not the same
    image at the same place on the other side, or runs past it."""
    by_offset = {image.offset: image for image in stored}
    for image in new:
        if image.offset >= shared:
            break
        same = by_offset.pop(image.offset, None)
        if same is None or same.digest != image.digest or image.offset + image.tokens > shared:
            return image.offset
    for offset in sorted(by_offset):  # stored images with no new image at their place
        if offset < shared:
            return offset
    return shared
