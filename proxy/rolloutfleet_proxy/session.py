"""One session: its exact token ids, loss mask and logprobs as compact typed arrays."""

from __future__ import annotations

import asyncio
import math
import time
from array import array
from collections.abc import Sequence
from typing import Any, NotRequired, TypedDict, Unpack

from rolloutfleet_wire.session_record import (
    RECORD_FIELDS,
    TURN_BOUND_FIELDS,
    UNKNOWN_TEMPERATURE,
    UNKNOWN_VERSION,
    SessionRecord,
    token_versions,
)


class TurnFields(TypedDict):
    """What a turn records besides its tokens: Session.append_turn takes them, the journal's turn
    record carries them."""

    message_count: int  # messages in the history after this turn's reply
    history_digest: bytes
    stopped: bool  # the output ended on a stop token
    stop_token: int | None
    model_version: NotRequired[int]  # UNKNOWN_VERSION when not given
    version_changes: NotRequired[Sequence[tuple[int, int]]]  # (output offset, version); none
    temperature: NotRequired[float]  # UNKNOWN_TEMPERATURE
    tempered: NotRequired[bool]  # False


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

    __slots__ = ("close_reason", "closed", "last_active", "lock")
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

    def append_turn(
        self, new_input_ids: array, output_ids: array, output_logprobs: array, **turn: Unpack[TurnFields]
    ) -> int:
        """Record one completed turn, generated under `model_version` from its first output token and
        under each of `version_changes` (offset into output_ids, version) from that offset on;
        returns the number of tokens added. Inputs are validated first."""
        version_changes = turn.get("version_changes", ())
        if len(output_ids) != len(output_logprobs):
            raise ValueError("output ids and logprobs differ in length")
        if any(not 0 < offset < len(output_ids) for offset, _ in version_changes):
            raise ValueError("version changes must fall inside the output")
        input_start = len(self.token_ids)
        output_start = input_start + len(new_input_ids)
        n_in, n_out = len(new_input_ids), len(output_ids)
        # Reserve all memory before mutating, so a failure cannot leave the arrays half-extended.
        zeros_in = bytes(n_in)
        self.token_ids.extend(new_input_ids)
        self.token_ids.extend(output_ids)
        self.loss_mask.frombytes(zeros_in)
        self.loss_mask.frombytes(b"\x01" * n_out)
        self.logprobs.frombytes(bytes(4 * n_in))
        self.logprobs.extend(output_logprobs)
        self.turn_bounds.extend((input_start, output_start, output_start + n_out))
        self.turn_versions.append(turn.get("model_version", UNKNOWN_VERSION))
        for offset, version in version_changes:
            self.version_changes.extend((output_start + offset, version))
        self.turn_temperatures.append(turn.get("temperature", UNKNOWN_TEMPERATURE))
        self.turn_tempered.append(1 if turn.get("tempered", False) else 0)
        self.message_count = turn["message_count"]
        self.history_digest = turn["history_digest"]
        self.last_output_stopped = turn["stopped"]
        self.last_stop_token = turn["stop_token"]
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
            self.message_count,
            self.history_digest,
            self.last_output_stopped,
            self.last_stop_token,
        )

    def rollback(self, mark: tuple) -> int:
        """Undo the turns appended since `mark` (their record could not be made durable); returns the
        number of tokens removed."""
        tokens, bounds, changes, *rest = mark
        removed = len(self.token_ids) - tokens
        turns = bounds // TURN_BOUND_FIELDS
        for values, length in (
            (self.token_ids, tokens),
            (self.loss_mask, tokens),
            (self.logprobs, tokens),
            (self.turn_bounds, bounds),
            (self.version_changes, changes),
            (self.turn_versions, turns),
            (self.turn_temperatures, turns),
            (self.turn_tempered, turns),
        ):
            del values[length:]
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
            "num_tokens": self.num_tokens,
            "num_messages": self.message_count,
            "finished": self.finished,
            "busy": self.busy,
            "reward": self.reward,
            "turn_rewards": {str(k): v for k, v in sorted((self.turn_rewards or {}).items())},
        }

    def trajectory(self) -> dict[str, Any]:
        return {
            "input_ids": self.token_ids.tolist(),
            "loss_mask": self.loss_mask.tolist(),
            "logprobs": self.logprobs.tolist(),
            "turns": [list(t) for t in self.turns()],
            "turn_versions": self.turn_versions.tolist(),
            "versions": token_versions(self).tolist(),
            "turn_temperatures": [None if math.isnan(t) else t for t in self.turn_temperatures],
            "turn_tempered": [bool(t) for t in self.turn_tempered],
        }
