"""The write-ahead journal's records: what each says, and their bytes (pure functions).

A record is framed as `MAGIC | payload length (u32) | CRC-32 of the payload (u32) | payload`; the
payload is `kind (u8) | header length (u32) | header (JSON) | body`. Only a turn has a body: its new
input ids (int32), output ids (int32) and output logprobs (float32), as the arrays hold them, then
its routing rows when it has any (routing replay: `routing` in the header is their byte count). A
turn's images are in its header by sha256 (their bytes are files in the dump directory's images/).

Every record names its session by id and incarnation (the first 8 bytes of the session key's digest),
so a record of a deleted session never applies to a later session that reuses the id. A turn carries
its index: replaying it on a snapshot that already holds it is a no-op, so a snapshot may be newer
than the journal it compacts.
"""

from __future__ import annotations

import math
import mmap
import struct
import zlib
from array import array
from dataclasses import dataclass, field
from typing import Any

import orjson
from rolloutfleet_wire.session_record import FINISH_UNKNOWN, NO_DIGEST, UNKNOWN_TEMPERATURE, ImageSpan

from ..session import RecordedTurn

MAGIC = b"RFJ1"
_FRAME = struct.Struct("<4sII")  # magic, payload length, crc32
_KIND_HEADER = struct.Struct("<BI")  # kind, header length
FRAME_BYTES = _FRAME.size
MAX_RECORD_BYTES = 1 << 30

CREATE, TURN, REWARD, FINISH, END = 1, 2, 3, 4, 5
KINDS = {CREATE: "create", TURN: "turn", REWARD: "reward", FINISH: "finish", END: "end"}


class RecordError(ValueError):
    """Bytes that are not a whole, intact record."""


@dataclass(frozen=True)
class TurnBody:
    new_input_ids: array
    output_ids: array
    output_logprobs: array
    routing: bytes | None = None


@dataclass(frozen=True)
class Record:
    kind: int
    header: dict[str, Any]
    turn: TurnBody | None = field(default=None)

    @property
    def session_id(self) -> str:
        return self.header["sid"]

    @property
    def incarnation(self) -> str:
        return self.header["inc"]


def incarnation(key_digest: bytes) -> str:
    return key_digest[:8].hex()


def frame(kind: int, header: dict[str, Any], body: bytes = b"") -> bytes:
    head = orjson.dumps(header)
    payload = _KIND_HEADER.pack(kind, len(head)) + head + body
    return _FRAME.pack(MAGIC, len(payload), zlib.crc32(payload)) + payload


def create_record(session_id: str, key_digest: bytes, created_at: float, metadata: dict[str, Any]) -> bytes:
    header = {
        "sid": session_id,
        "inc": incarnation(key_digest),
        "key": key_digest.hex(),
        "created_at": created_at,
        "metadata": metadata,
    }
    return frame(CREATE, header)


def turn_record(session_id: str, key_digest: bytes, turn_index: int, turn: RecordedTurn) -> bytes:
    header = {
        "sid": session_id,
        "inc": incarnation(key_digest),
        "turn": turn_index,
        "n_in": len(turn.new_input_ids),
        "n_out": len(turn.output_ids),
        "message_count": turn.message_count,
        "digest": turn.history_digest.hex(),
        "stopped": turn.stopped,
        "stop_token": turn.stop_token,
        "version": turn.model_version,
        "changes": [list(c) for c in turn.version_changes],
        "temperature": None if math.isnan(turn.temperature) else turn.temperature,
        "tempered": turn.tempered,
    }
    # The tree and the replay (absent in records written before trees: a linear turn, not replayable).
    for name in ("parent", "keep", "call"):
        if getattr(turn, name) is not None:
            header[name] = getattr(turn, name)
    header.update(
        finish=turn.finish,
        flags=turn.flags,
        created=turn.created,
        stop_string=turn.stop_string,
        idempotency_key=turn.idempotency_key,
        request=turn.request_digest.hex(),
    )
    if turn.images:  # offsets into the turn's new input ids; the bytes are in images/, by sha256
        header["images"] = [[*image[:5], image.digest.hex()] for image in turn.images]
    body = turn.new_input_ids.tobytes() + turn.output_ids.tobytes() + turn.output_logprobs.tobytes()
    if turn.routing is not None:
        header["routing"] = len(turn.routing)
        body += turn.routing
    return frame(TURN, header, body)


def recorded_turn(record: Record) -> RecordedTurn:
    """A turn record back as the turn it recorded; KeyError, TypeError or ValueError if malformed.
    Keys absent in records written before trees get the defaults of a linear turn."""
    header, body = record.header, record.turn
    assert body is not None, "a turn record"
    temperature = header.get("temperature")
    return RecordedTurn(
        body.new_input_ids,
        body.output_ids,
        body.output_logprobs,
        message_count=int(header["message_count"]),
        history_digest=bytes.fromhex(header["digest"]),
        stopped=bool(header["stopped"]),
        stop_token=header.get("stop_token"),
        model_version=int(header["version"]),
        version_changes=tuple((int(o), int(v)) for o, v in header.get("changes") or []),
        temperature=UNKNOWN_TEMPERATURE if temperature is None else float(temperature),
        tempered=bool(header.get("tempered")),
        parent=int(header["parent"]) if "parent" in header else None,
        keep=int(header["keep"]) if "keep" in header else None,
        call=int(header["call"]) if "call" in header else None,
        request_digest=bytes.fromhex(header["request"]) if "request" in header else NO_DIGEST,
        finish=int(header.get("finish", FINISH_UNKNOWN)),
        flags=int(header.get("flags", 0)),
        created=float(header.get("created", 0.0)),
        stop_string=_optional_str(header.get("stop_string")),
        idempotency_key=_optional_str(header.get("idempotency_key")),
        images=tuple(
            ImageSpan(int(o), int(n), int(t), int(h), int(w), bytes.fromhex(d))
            for o, n, t, h, w, d in header.get("images") or ()
        ),
        routing=body.routing,
    )


def _optional_str(value: Any) -> str | None:
    return None if value is None else str(value)


def reward_record(session_id: str, key_digest: bytes, value: float, turn: int | None) -> bytes:
    return frame(REWARD, {"sid": session_id, "inc": incarnation(key_digest), "value": value, "turn": turn})


def finish_record(session_id: str, key_digest: bytes) -> bytes:
    return frame(FINISH, {"sid": session_id, "inc": incarnation(key_digest)})


def end_record(session_id: str, key_digest: bytes, reason: str) -> bytes:
    return frame(END, {"sid": session_id, "inc": incarnation(key_digest), "reason": reason})


def decode_payload(payload: bytes) -> Record:
    """A record from an intact payload (its CRC already checked); RecordError if it is malformed."""
    try:
        kind, head_len = _KIND_HEADER.unpack_from(payload)
        start = _KIND_HEADER.size
        header = orjson.loads(payload[start : start + head_len])
        body = memoryview(payload)[start + head_len :]
        if kind not in KINDS or not isinstance(header, dict):
            raise RecordError(f"unknown record kind {kind}")
        if not isinstance(header.get("sid"), str) or not isinstance(header.get("inc"), str):
            raise RecordError("record without a session")
        if kind != TURN:
            return Record(kind, header)
        n_in, n_out = int(header["n_in"]), int(header["n_out"])
        routing_bytes = header.get("routing")
        tokens_end = 4 * (n_in + 2 * n_out)
        if (
            n_in < 0
            or n_out < 0
            or (routing_bytes is not None and (not isinstance(routing_bytes, int) or routing_bytes < 0))
            or len(body) != tokens_end + (routing_bytes or 0)
        ):
            raise RecordError("turn body does not match its lengths")
        new_input_ids = _array("i", body[: 4 * n_in])
        output_ids = _array("i", body[4 * n_in : 4 * (n_in + n_out)])
        logprobs = _array("f", body[4 * (n_in + n_out) : tokens_end])
        routing = None if routing_bytes is None else bytes(body[tokens_end:])
        return Record(kind, header, TurnBody(new_input_ids, output_ids, logprobs, routing))
    except RecordError:
        raise
    except (struct.error, orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise RecordError(f"malformed record: {type(exc).__name__}: {exc}") from None


def _array(typecode: str, data: memoryview) -> array:
    values = array(typecode)
    values.frombytes(data)
    return values


@dataclass
class ScanResult:
    records: list[Record]
    good_bytes: int  # the prefix of the segment that holds intact records, up to the first bad one
    damaged: bool  # something after good_bytes failed verification and was not just a torn tail
    skipped_bytes: int  # bytes after good_bytes that could not be read as records


def scan(data: bytes | mmap.mmap) -> ScanResult:
    """Every intact record of a segment, in order. Bad bytes with nothing intact after them are the
    append a crash cut short (never fsynced, so never acknowledged): the scan ends there quietly. Bad
    bytes followed by intact records are damage: the scan resynchronises on the next intact record
    and reports what it skipped."""
    records: list[Record] = []
    pos, good, skipped, damaged = 0, None, 0, False
    size = len(data)
    while pos < size:
        record, end = _read_at(data, pos)
        if record is not None:
            records.append(record)
            pos = end
            continue
        if good is None:
            good = pos
        resync = _next_intact(data, pos + 1)
        if resync is None:  # nothing intact after it: the append a crash cut short (never acknowledged)
            skipped += size - pos
            break
        damaged = True
        skipped += resync - pos
        pos = resync
    return ScanResult(records, size if good is None else good, damaged, skipped)


def _read_at(data: bytes | mmap.mmap, pos: int) -> tuple[Record | None, int]:
    if pos + FRAME_BYTES > len(data):
        return None, pos
    magic, length, crc = _FRAME.unpack_from(data, pos)
    end = pos + FRAME_BYTES + length
    if magic != MAGIC or length > MAX_RECORD_BYTES or end > len(data):
        return None, pos
    payload = data[pos + FRAME_BYTES : end]
    if zlib.crc32(payload) != crc:
        return None, pos
    try:
        return decode_payload(payload), end
    except RecordError:
        return None, pos


def _next_intact(data: bytes | mmap.mmap, start: int) -> int | None:
    pos = data.find(MAGIC, start)
    while pos != -1:
        if _read_at(data, pos)[0] is not None:
            return pos
        pos = data.find(MAGIC, pos + 1)
    return None
