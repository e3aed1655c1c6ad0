"""One session: its exact token ids, loss mask and logprobs as compact typed arrays."""

from __future__ import annotations

import asyncio
import math
import time
from array import array
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from rolloutfleet_wire.session_record import (
    EMPTY_DIGEST,
    TURN_BOUND_FIELDS,
    UNKNOWN_TEMPERATURE,
    UNKNOWN_VERSION,
    SessionRecord,
    token_versions,
)


class Session:
    """Live state of a session. Mutated only while its lock is held (turns) or after it is detached."""

    __slots__ = (
        "close_reason",
        "closed",
        "created_at",
        "finished",
        "history_digest",
        "key_digest",
        "last_active",
        "last_output_stopped",
        "last_stop_token",
        "lock",
        "logprobs",
        "loss_mask",
        "message_count",
        "metadata",
        "reward",
        "session_id",
        "token_ids",
        "turn_bounds",
        "turn_rewards",
        "turn_temperatures",
        "turn_tempered",
        "turn_versions",
        "version_changes",
    )

    def __init__(
        self,
        session_id: str,
        key_digest: bytes,
        metadata: dict[str, Any] | None = None,
        created_at: float | None = None,
    ):
        self.session_id = session_id
        self.key_digest = key_digest
        self.metadata = metadata or {}
        self.created_at = time.time() if created_at is None else created_at
        self.token_ids = array("i")
        self.loss_mask = array("B")
        self.logprobs = array("f")
        self.turn_bounds = array("i")
        self.turn_versions = array("i")
        self.version_changes = array("i")
        self.turn_temperatures = array("f")
        self.turn_tempered = array("B")
        self.message_count = 0
        self.history_digest = EMPTY_DIGEST
        self.last_output_stopped = False
        self.last_stop_token: int | None = None
        self.reward: float | None = None
        self.turn_rewards: dict[int, float] | None = None
        self.finished = False
        self.lock = asyncio.Lock()
        self.closed = False
        self.close_reason = ""
        self.last_active = time.monotonic()

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
        self,
        new_input_ids: array,
        output_ids: array,
        output_logprobs: array,
        *,
        message_count: int,
        history_digest: bytes,
        stopped: bool,
        stop_token: int | None,
        model_version: int = UNKNOWN_VERSION,
        version_changes: Sequence[tuple[int, int]] = (),
        temperature: float = UNKNOWN_TEMPERATURE,
        tempered: bool = False,
    ) -> int:
        """Record one completed turn, generated under `model_version` from its first output token and
        under each of `version_changes` (offset into output_ids, version) from that offset on;
        returns the number of tokens added. Inputs are validated first."""
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
        self.turn_versions.append(model_version)
        for offset, version in version_changes:
            self.version_changes.extend((output_start + offset, version))
        self.turn_temperatures.append(temperature)
        self.turn_tempered.append(1 if tempered else 0)
        self.message_count = message_count
        self.history_digest = history_digest
        self.last_output_stopped = stopped
        self.last_stop_token = stop_token
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
        return SessionRecord(
            session_id=self.session_id,
            key_digest=self.key_digest,
            created_at=self.created_at,
            metadata=self.metadata,
            token_ids=self.token_ids,
            loss_mask=self.loss_mask,
            logprobs=self.logprobs,
            turn_bounds=self.turn_bounds,
            turn_versions=self.turn_versions,
            version_changes=self.version_changes,
            turn_temperatures=self.turn_temperatures,
            turn_tempered=self.turn_tempered,
            message_count=self.message_count,
            history_digest=self.history_digest,
            last_output_stopped=self.last_output_stopped,
            last_stop_token=self.last_stop_token,
            reward=self.reward,
            turn_rewards=dict(self.turn_rewards or {}),
            finished=self.finished,
        )

    def copied_record(self) -> SessionRecord:
        """A snapshot that owns its arrays (a memcpy each): safe to serialize in a worker thread while
        the session goes on taking turns. Every mutation is synchronous, so a copy made on the event
        loop is always of a whole state."""
        record = self.to_record()
        return replace(
            record,
            metadata=dict(record.metadata),
            token_ids=array("i", record.token_ids),
            loss_mask=array("B", record.loss_mask),
            logprobs=array("f", record.logprobs),
            turn_bounds=array("i", record.turn_bounds),
            turn_versions=array("i", record.turn_versions),
            version_changes=array("i", record.version_changes),
            turn_temperatures=array("f", record.turn_temperatures),
            turn_tempered=array("B", record.turn_tempered),
        )

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
        session = cls(record.session_id, record.key_digest, record.metadata, record.created_at)
        session.token_ids = record.token_ids
        session.loss_mask = record.loss_mask
        session.logprobs = record.logprobs
        session.turn_bounds = record.turn_bounds
        session.turn_versions = record.turn_versions
        session.version_changes = record.version_changes
        session.turn_temperatures = record.turn_temperatures
        session.turn_tempered = record.turn_tempered
        session.message_count = record.message_count
        session.history_digest = record.history_digest
        session.last_output_stopped = record.last_output_stopped
        session.last_stop_token = record.last_stop_token
        session.reward = record.reward
        session.turn_rewards = dict(record.turn_rewards) or None
        session.finished = record.finished
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
            "versions": token_versions(self.to_record()).tolist(),
            "turn_temperatures": [None if math.isnan(t) else t for t in self.turn_temperatures],
            "turn_tempered": [bool(t) for t in self.turn_tempered],
        }
