"""A session's persistent record: what dumps and the journal hold, what exports are made of.

Shared by the proxy (which records it) and the trainer's client (which reads exports of it).
"""

from __future__ import annotations

import bisect
from array import array
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

# The digest of an empty message history (a session before its first turn).
EMPTY_DIGEST = b"\x00" * 32
# Per-turn bounds: (first new input token, first output token, end of output) offsets into token_ids.
TURN_BOUND_FIELDS = 3
# The model version of a turn generated before versions were recorded (and of non-generated tokens).
UNKNOWN_VERSION = -1
# The temperature of a turn recorded before temperatures were.
UNKNOWN_TEMPERATURE = float("nan")
# The per-turn digests (of the conversation after the turn's reply, and of the request it answered)
# are this many bytes each, back to back; all zeros: not recorded (files written before trees).
DIGEST_BYTES = 32
NO_DIGEST = bytes(DIGEST_BYTES)
# turn_parents value of a turn that starts at the root (the first prompt of a branch).
ROOT = -1
# turn_stop_tokens value of a turn whose output did not end on a stop token.
NO_STOP_TOKEN = -1
# turn_finishes values: how SGLang ended the turn's generation.
FINISH_UNKNOWN, FINISH_STOP, FINISH_LENGTH, FINISH_ABORT = 0, 1, 2, 3
FINISH_CODES = {"stop": FINISH_STOP, "length": FINISH_LENGTH, "abort": FINISH_ABORT}
FINISH_NAMES = {code: name for name, code in FINISH_CODES.items()}
# turn_flags bits.
FLAG_PROMPT_OPENS_REASONING = 1  # the generation prompt ended inside a reasoning block
# version_changes holds (absolute token offset, version) pairs: from that offset to the end of its
# turn (or the next change) the tokens were generated under that version. Only turns that span a
# weight update have any, so the common case costs nothing per token.
VERSION_CHANGE_FIELDS = 2
# image_spans holds IMAGE_FIELDS ints per image of a prompt (vision-language models): the absolute
# offset of its first image token in token_ids, its token count (the run of placeholder tokens the
# engine expanded it to), and its grid (t, h, w) in patches; image_digests the sha256 of its bytes
# (DIGEST_BYTES each), in the same order: recording order, so offsets ascend.
IMAGE_FIELDS = 5


class ImageSpan(NamedTuple):
    """One image of a prompt: where its tokens start (`offset`, in the coordinates of the ids it is
    given with), how many there are, its grid in patches and the sha256 of its bytes."""

    offset: int
    tokens: int
    grid_t: int
    grid_h: int
    grid_w: int
    digest: bytes

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.grid_t, self.grid_h, self.grid_w)


# Slots: the proxy's live Session extends this record, and it holds many sessions.
@dataclass(slots=True)
class SessionRecord:
    """Everything persistent about a session; what dumps write and restores read. A new persistent
    field is added here, given its place in the proxy's dump format (`dumps._TENSORS` or `_HEADER`:
    the proxy does not import until it has one), and to the journal if turns change it."""

    session_id: str
    key_digest: bytes
    created_at: float
    metadata: dict[str, Any]
    token_ids: array[int]
    loss_mask: array[int]
    logprobs: array[float]
    turn_bounds: array[int]
    # The model version per turn (at its start).
    turn_versions: array[int] = field(default_factory=lambda: array("i"))
    version_changes: array[int] = field(default_factory=lambda: array("i"))  # see VERSION_CHANGE_FIELDS
    # The sampling temperature per turn.
    turn_temperatures: array[float] = field(default_factory=lambda: array("f"))
    # 1 per turn whose logprobs are of logits / temperature.
    turn_tempered: array[int] = field(default_factory=lambda: array("B"))
    # The tree (see session_tree.py): turn t's tokens are the first turn_keeps[t] tokens of the path
    # to turn_parents[t] (ROOT: none), then its own segment (turn_bounds[t]). Its call is the first
    # turn recorded by the same request (several for n > 1).
    turn_parents: array[int] = field(default_factory=lambda: array("i"))
    turn_keeps: array[int] = field(default_factory=lambda: array("i"))
    turn_calls: array[int] = field(default_factory=lambda: array("i"))
    turn_stop_tokens: array[int] = field(default_factory=lambda: array("i"))  # NO_STOP_TOKEN: none
    turn_message_counts: array[int] = field(default_factory=lambda: array("i"))  # after the reply
    turn_end_digests: array[int] = field(default_factory=lambda: array("B"))  # DIGEST_BYTES per turn
    turn_request_digests: array[int] = field(default_factory=lambda: array("B"))  # DIGEST_BYTES per turn
    turn_finishes: array[int] = field(default_factory=lambda: array("B"))  # FINISH_* codes
    turn_flags: array[int] = field(default_factory=lambda: array("B"))  # FLAG_* bits
    turn_created: array[float] = field(default_factory=lambda: array("d"))  # unix time of the reply
    # The prompts' images, by absolute token offset (see IMAGE_FIELDS); none for a text-only session.
    image_spans: array[int] = field(default_factory=lambda: array("i"))
    image_digests: array[int] = field(default_factory=lambda: array("B"))
    # Routing replay (routed_experts.py): 1 per turn that stored its rows of expert ids (they are on
    # the dump volume, not here), and the CRC-32 of those rows.
    turn_routed: array[int] = field(default_factory=lambda: array("B"))
    turn_routing_crcs: array[int] = field(default_factory=lambda: array("I"))
    # Rare per-turn and per-call values, by turn index.
    turn_stop_strings: dict[int, str] = field(default_factory=dict)  # the stop string that ended it
    idempotency_keys: dict[str, int] = field(default_factory=dict)  # key digest (hex) -> call
    message_count: int = 0
    history_digest: bytes = EMPTY_DIGEST
    last_output_stopped: bool = False
    last_stop_token: int | None = None
    reward: float | None = None
    turn_rewards: dict[int, float] = field(default_factory=dict)
    finished: bool = False


# The persistent fields, in declaration order.
RECORD_FIELDS = tuple(f.name for f in fields(SessionRecord))


def token_versions(record: SessionRecord) -> array[int]:
    """The model version of every token of `token_ids` (each turn's own segment, in recording order):
    its turn's version on generated tokens, then any mid-turn changes; UNKNOWN_VERSION on prompt
    tokens."""
    versions = array("i", [UNKNOWN_VERSION]) * len(record.token_ids)
    bounds = record.turn_bounds
    for turn, version in enumerate(record.turn_versions):
        _, output_start, end = bounds[turn * TURN_BOUND_FIELDS : (turn + 1) * TURN_BOUND_FIELDS]
        versions[output_start:end] = array("i", [version]) * (end - output_start)
    changes = record.version_changes
    turn_ends = sorted(bounds[i + 2] for i in range(0, len(bounds), TURN_BOUND_FIELDS))
    for i in range(0, len(changes), VERSION_CHANGE_FIELDS):
        start, version = changes[i], changes[i + 1]
        after = bisect.bisect_right(turn_ends, start)
        end = turn_ends[after] if after < len(turn_ends) else len(versions)
        versions[start:end] = array("i", [version]) * (end - start)
    return versions


def image_spans(record: SessionRecord) -> list[ImageSpan]:
    """Every image of the record's prompts, in recording order (ascending offsets)."""
    spans, digests = record.image_spans, record.image_digests
    found = []
    for i in range(len(spans) // IMAGE_FIELDS):
        offset, tokens, grid_t, grid_h, grid_w = spans[i * IMAGE_FIELDS : (i + 1) * IMAGE_FIELDS]
        digest = digests[i * DIGEST_BYTES : (i + 1) * DIGEST_BYTES].tobytes()
        found.append(ImageSpan(offset, tokens, grid_t, grid_h, grid_w, digest))
    return found


def turn_finish(record: SessionRecord, turn: int) -> int:
    """How turn `turn` ended (FINISH_*); FINISH_UNKNOWN for a turn recorded before finishes were."""
    return record.turn_finishes[turn] if turn < len(record.turn_finishes) else FINISH_UNKNOWN
