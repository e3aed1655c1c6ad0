"""One session: its exact token ids, loss mask and logprobs as compact typed arrays."""

from __future__ import annotations

import asyncio
import math
import time
import zlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rolloutfleet_wire import session_tree as tree
from rolloutfleet_wire.session_record import (
    DIGEST_BYTES,
    FINISH_UNKNOWN,
    IMAGE_FIELDS,
    NO_DIGEST,
    NO_STOP_TOKEN,
    RECORD_FIELDS,
    ROOT,
    TURN_BOUND_FIELDS,
    UNKNOWN_TEMPERATURE,
    UNKNOWN_VERSION,
    ImageSpan,
    SessionRecord,
    image_spans,
    token_versions,
)

# The record's per-turn arrays: one value (or DIGEST_BYTES values) per turn, cut back together.
PER_TURN_ARRAYS = (
    "turn_versions",
    "turn_temperatures",
    "turn_tempered",
    "turn_parents",
    "turn_keeps",
    "turn_calls",
    "turn_stop_tokens",
    "turn_message_counts",
    "turn_finishes",
    "turn_flags",
    "turn_created",
    "turn_routed",
    "turn_routing_crcs",
)
PER_TURN_DIGESTS = ("turn_end_digests", "turn_request_digests")


@dataclass(frozen=True)
class RecordedTurn:
    """One turn as it is recorded: its tokens and everything it records besides them. Built once (by
    the turn that generated it, or from its journal record on restore) and handed as it is to the
    session (`Session.append_turn`) and the journal (`journal_records.turn_record`)."""

    new_input_ids: array  # int32: the prompt ids the turn adds after what it keeps of its parent's path
    output_ids: array  # int32
    output_logprobs: array  # float32, one per output id
    message_count: int  # messages in the history after this turn's reply
    history_digest: bytes
    stopped: bool  # the output ended on a stop token
    stop_token: int | None
    model_version: int = UNKNOWN_VERSION  # the version its generation started under
    version_changes: Sequence[tuple[int, int]] = ()  # (output offset, version) where a weight update hit
    temperature: float = UNKNOWN_TEMPERATURE
    tempered: bool = False
    # Where the turn sits in the tree; None (journal records written before trees): it continues the
    # latest turn's whole path, and is the first turn of its own call.
    parent: int | None = None
    keep: int | None = None
    call: int | None = None  # the first turn of its request
    request_digest: bytes = NO_DIGEST  # NO_DIGEST: not replayable
    finish: int = FINISH_UNKNOWN  # FINISH_* code
    flags: int = 0  # FLAG_* bits
    created: float = 0.0  # unix time of the reply
    stop_string: str | None = None
    idempotency_key: str | None = None  # the key's digest (hex), on a call's first turn
    # The images among new_input_ids, offsets into new_input_ids, in order (vision-language models).
    images: tuple[ImageSpan, ...] = ()
    # Routing replay: the rows of expert ids the turn stores (routed_experts.turn_rows of them, in the
    # fleet's dtype), on their way to the journal and the routing store; the session keeps their CRC.
    routing: bytes | None = None


def check_images(images: Sequence[ImageSpan], input_length: int) -> None:
    """Images lie inside the prompt ids they come with, in order, without overlapping."""
    end = 0
    for image in images:
        if image.offset < end or image.tokens < 1 or image.offset + image.tokens > input_length:
            raise ValueError(f"image of {image.tokens} tokens at {image.offset} is not inside the new input")
        if len(image.digest) != DIGEST_BYTES or min(image.grid) < 1:
            raise ValueError("an image needs a sha256 digest and a grid of positive sizes")
        end = image.offset + image.tokens


def _owned(value: Any) -> Any:
    """A copy of a mutable field value (arrays are a memcpy each); immutable values as they are."""
    if isinstance(value, array):
        return array(value.typecode, value)
    if isinstance(value, dict):
        return dict(value)
    return value


class Session(SessionRecord):
    """Live state of a session: its persistent record (the fields of SessionRecord, declared there
    only) and what lives only in this process. Mutated only while its lock is held (turns) or after it
    is detached. Unlike a record, a session compares by identity."""

    # committed_turns: turns durable in the journal (a turn appended but not yet committed may still
    # be rolled back, so it is never replayed).
    __slots__ = ("close_reason", "closed", "committed_turns", "last_active", "lock")
    __eq__ = object.__eq__
    __hash__ = object.__hash__

    # Per-turn rewards are rare: None rather than an empty dict per session (the record holds a dict).
    turn_rewards: dict[int, float] | None  # type: ignore[assignment]

    def __init__(
        self,
        session_id: str,
        key_digest: bytes,
        metadata: dict[str, Any] | None = None,
        created_at: float | None = None,
    ):
        super().__init__(
            session_id=session_id,
            key_digest=key_digest,
            created_at=time.time() if created_at is None else created_at,
            metadata=metadata or {},
            token_ids=array("i"),
            loss_mask=array("B"),
            logprobs=array("f"),
            turn_bounds=array("i"),
        )
        self.turn_rewards = None
        self._start_live()

    def _start_live(self) -> None:
        self.lock = asyncio.Lock()
        self.closed = False
        self.close_reason = ""
        self.last_active = time.monotonic()
        self.committed_turns = self.num_turns

    def __repr__(self) -> str:
        return f"Session({self.session_id!r}, turns={self.num_turns}, tokens={self.num_tokens})"

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_turns(self) -> int:
        return len(self.turn_bounds) // TURN_BOUND_FIELDS

    @property
    def busy(self) -> bool:
        return self.lock.locked()

    def touch(self) -> None:
        self.last_active = time.monotonic()

    def idle_seconds(self, now: float) -> float:
        return now - self.last_active

    def append_turn(self, turn: RecordedTurn) -> int:
        """Record one completed turn, generated under `turn.model_version` from its first output token
        and under each of `turn.version_changes` (offset into output_ids, version) from that offset on;
        returns the number of tokens added. The turn is validated first."""
        if len(turn.output_ids) != len(turn.output_logprobs):
            raise ValueError("output ids and logprobs differ in length")
        if any(not 0 < offset < len(turn.output_ids) for offset, _ in turn.version_changes):
            raise ValueError("version changes must fall inside the output")
        index = self.num_turns
        parent = index - 1 if turn.parent is None else turn.parent
        if not ROOT <= parent < index:
            raise ValueError(f"turn {index} cannot continue turn {parent}")
        keep = tree.path_length(self, parent) if turn.keep is None else turn.keep
        if not 0 <= keep <= tree.path_length(self, parent):
            raise ValueError(f"turn {index} cannot keep {keep} tokens of turn {parent}'s path")
        for name in ("history_digest", "request_digest"):
            if len(getattr(turn, name)) != DIGEST_BYTES:
                raise ValueError(f"{name} must be {DIGEST_BYTES} bytes")
        check_images(turn.images, len(turn.new_input_ids))
        call = index if turn.call is None else turn.call
        input_start = len(self.token_ids)
        output_start = input_start + len(turn.new_input_ids)
        n_in, n_out = len(turn.new_input_ids), len(turn.output_ids)
        # Reserve all memory before mutating, so a failure cannot leave the arrays half-extended.
        zeros_in = bytes(n_in)
        self.token_ids.extend(turn.new_input_ids)
        self.token_ids.extend(turn.output_ids)
        self.loss_mask.frombytes(zeros_in)
        self.loss_mask.frombytes(b"\x01" * n_out)
        self.logprobs.frombytes(bytes(4 * n_in))
        self.logprobs.extend(turn.output_logprobs)
        self.turn_bounds.extend((input_start, output_start, output_start + n_out))
        self.turn_versions.append(turn.model_version)
        for offset, version in turn.version_changes:
            self.version_changes.extend((output_start + offset, version))
        self.turn_temperatures.append(turn.temperature)
        self.turn_tempered.append(1 if turn.tempered else 0)
        self.turn_parents.append(parent)
        self.turn_keeps.append(keep)
        self.turn_calls.append(call)
        self.turn_stop_tokens.append(NO_STOP_TOKEN if turn.stop_token is None else turn.stop_token)
        self.turn_message_counts.append(turn.message_count)
        self.turn_end_digests.frombytes(turn.history_digest)
        self.turn_request_digests.frombytes(turn.request_digest)
        self.turn_finishes.append(turn.finish)
        self.turn_flags.append(turn.flags)
        self.turn_created.append(turn.created)
        self.turn_routed.append(0 if turn.routing is None else 1)
        self.turn_routing_crcs.append(0 if turn.routing is None else zlib.crc32(turn.routing))
        for image in turn.images:
            self.image_spans.extend(
                (input_start + image.offset, image.tokens, image.grid_t, image.grid_h, image.grid_w)
            )
            self.image_digests.frombytes(image.digest)
        if turn.stop_string:
            self.turn_stop_strings[index] = turn.stop_string
        if turn.idempotency_key:
            self.idempotency_keys[turn.idempotency_key] = call
        self.message_count = turn.message_count
        self.history_digest = turn.history_digest
        self.last_output_stopped = turn.stopped
        self.last_stop_token = turn.stop_token
        return n_in + n_out

    def set_reward(self, value: float, turn: int | None) -> None:
        if turn is None:
            self.reward = value
            return
        if self.turn_rewards is None:
            self.turn_rewards = {}
        self.turn_rewards[turn] = value

    def turns(self) -> list[tuple[int, int, int]]:
        b = self.turn_bounds
        return [(b[i], b[i + 1], b[i + 2]) for i in range(0, len(b), TURN_BOUND_FIELDS)]

    def to_record(self) -> SessionRecord:
        """Snapshot for a dump. Shares the arrays: only call on a detached or locked session."""
        values = {name: getattr(self, name) for name in RECORD_FIELDS}
        values["turn_rewards"] = dict(self.turn_rewards or {})
        return SessionRecord(**values)

    def copied_record(self) -> SessionRecord:
        """A snapshot that owns its arrays (a memcpy each): safe to serialize in a worker thread while
        the session goes on taking turns. Every mutation is synchronous, so a copy made on the event
        loop is always of a whole state."""
        values = {name: _owned(getattr(self, name)) for name in RECORD_FIELDS}
        values["turn_rewards"] = dict(self.turn_rewards or {})
        return SessionRecord(**values)

    def mark(self) -> tuple:
        """What `rollback` restores: the state before a turn is appended."""
        return (
            len(self.token_ids),
            len(self.turn_bounds),
            len(self.version_changes),
            len(self.image_spans),
            dict(self.idempotency_keys),
            self.message_count,
            self.history_digest,
            self.last_output_stopped,
            self.last_stop_token,
        )

    def rollback(self, mark: tuple) -> int:
        """Undo the turns appended since `mark` (their record could not be made durable); returns the
        number of tokens removed."""
        tokens, bounds, changes, images, keys, *rest = mark
        removed = len(self.token_ids) - tokens
        turns = bounds // TURN_BOUND_FIELDS
        for values, length in (
            (self.token_ids, tokens),
            (self.loss_mask, tokens),
            (self.logprobs, tokens),
            (self.turn_bounds, bounds),
            (self.version_changes, changes),
            (self.image_spans, images),
            (self.image_digests, images // IMAGE_FIELDS * DIGEST_BYTES),
        ):
            del values[length:]
        for name in PER_TURN_ARRAYS:
            del getattr(self, name)[turns:]
        for name in PER_TURN_DIGESTS:
            del getattr(self, name)[turns * DIGEST_BYTES :]
        for turn in [t for t in self.turn_stop_strings if t >= turns]:
            del self.turn_stop_strings[turn]
        self.idempotency_keys = keys
        (
            self.message_count,
            self.history_digest,
            self.last_output_stopped,
            self.last_stop_token,
        ) = rest
        return removed

    @classmethod
    def from_record(cls, record: SessionRecord) -> Session:
        """The session a record holds; it takes over the record's arrays."""
        session = cls.__new__(cls)
        SessionRecord.__init__(session, **{name: getattr(record, name) for name in RECORD_FIELDS})
        session.turn_rewards = dict(record.turn_rewards) or None
        session._start_live()
        return session

    def summary(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "created_at": self.created_at,
            "metadata": self.metadata,
            "num_turns": self.num_turns,
            "num_branches": len(tree.leaves(self)),
            "num_tokens": self.num_tokens,
            "num_messages": self.message_count,
            "finished": self.finished,
            "busy": self.busy,
            "reward": self.reward,
            "turn_rewards": {str(k): v for k, v in sorted((self.turn_rewards or {}).items())},
        }

    def trajectory(self) -> dict[str, Any]:
        """The path to the latest turn (a linear session: everything), and the tree's shape."""
        latest = self.num_turns - 1
        path = tree.path_record(self, latest, self.reward) if latest >= 0 else self.to_record()
        return {
            "input_ids": path.token_ids.tolist(),
            "loss_mask": path.loss_mask.tolist(),
            "logprobs": path.logprobs.tolist(),
            "turns": [list(path.turn_bounds[i : i + 3]) for i in range(0, len(path.turn_bounds), 3)],
            "turn_versions": path.turn_versions.tolist(),
            "versions": token_versions(path).tolist(),
            "turn_temperatures": [None if math.isnan(t) else t for t in path.turn_temperatures],
            "turn_tempered": [bool(t) for t in path.turn_tempered],
            "path": tree.path_turns(self, latest) if latest >= 0 else [],
            "turn_parents": self.turn_parents.tolist(),
            "turn_calls": self.turn_calls.tolist(),
            "leaves": tree.leaves(self),
            # The path's images: where each one's tokens start in input_ids, how many, its grid.
            "images": [
                {"offset": i.offset, "tokens": i.tokens, "grid_thw": list(i.grid), "sha256": i.digest.hex()}
                for i in image_spans(path)
            ],
        }
