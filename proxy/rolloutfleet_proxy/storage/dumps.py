"""Session dump files: a self-describing safetensors file per session, written atomically.

Layout of a dump directory:
    live/<session_id>.safetensors             sessions drained at shutdown; restored on the next start
    stale/<session_id>.<unix_ms>.safetensors  sessions evicted after idling past the timeout
    live-exports/<batch_id>.safetensors       exported batches not yet acknowledged at shutdown; restored
    exported/<batch_id>.<unix_ms>.safetensors exported batches never acknowledged within the export TTL
    corrupt/                                  files that could not be read back (kept, not deleted)
    state.json                                model version, pause and admission counters

A session file holds the tensors `input_ids` (int32), `loss_mask` (uint8), `logprobs` (float32),
`turn_bounds` (int32, [turns, 3]: first new input token, first output token, end of output) and
`turn_versions` (int32, [turns]: the model version each turn's generation started under),
`version_changes` (int32, [changes, 2]: token offset and version where a weight update changed the
version mid-turn), `turn_temperatures` (float32) and `turn_tempered` (uint8), the tree and image
tensors, `turn_routed` (uint8) and `turn_routing_crcs` (uint32: routing replay; the rows themselves
are in `routing/`), and under the
metadata key `rolloutfleet.session` a JSON object with the rest of the session. Any safetensors
reader reads it; `load_session_file` turns it back into a `SessionRecord`. Batch files are in the
export format (`rolloutfleet_wire/export_format.py`).
"""

from __future__ import annotations

import os
import secrets
import time
import zlib
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from rolloutfleet_wire import session_tree as tree
from rolloutfleet_wire.session_record import (
    DIGEST_BYTES,
    FINISH_UNKNOWN,
    IMAGE_FIELDS,
    NO_DIGEST,
    NO_STOP_TOKEN,
    RECORD_FIELDS,
    TURN_BOUND_FIELDS,
    UNKNOWN_TEMPERATURE,
    UNKNOWN_VERSION,
    VERSION_CHANGE_FIELDS,
    SessionRecord,
)
from safetensors import safe_open
from safetensors.numpy import save as safetensors_save

from ..ids import is_valid_session_id

FORMAT = "rolloutfleet.session"
FORMAT_VERSION = 2  # 2: CRC-32 of every tensor in the header (`checksums`); 1 is still read
READABLE_VERSIONS = (1, 2)
LIVE_AREA = "live"
STALE_AREA = "stale"
LIVE_EXPORTS_AREA = "live-exports"
EXPORTED_AREA = "exported"
CORRUPT_AREA = "corrupt"
SUFFIX = ".safetensors"


class DumpFormatError(ValueError):
    pass


# --- how each persistent field is stored ---------------------------------------------------------
# Every field of SessionRecord is in exactly one of the two tables (checked below, at import): a new
# persistent field is declared on the record and given its storage here, and nowhere else.


@dataclass(frozen=True)
class _Tensor:
    """A record field stored as a tensor (the record holds it as a flat `array`)."""

    name: str  # the tensor's name in the file
    typecode: str  # the record's array typecode
    dtype: type  # the tensor's dtype
    columns: int = 1  # values per row: a tensor of [rows, columns]
    per_turn: bool = False  # one row per turn
    # The value for files written before this tensor existed, from what was read before it (the
    # header's values and the tensors above it in the table); None: required.
    older_files: Callable[[dict[str, Any]], list] | None = None


@dataclass(frozen=True)
class _HeaderValue:
    """A record field stored in the JSON header."""

    key: str  # the header's key
    encode: Callable[[Any], Any] = lambda value: value
    decode: Callable[[Any], Any] = lambda value: value
    # The value for files written without this key; None: required.
    older_files: Callable[[], Any] | None = None


def _turns(values: dict[str, Any]) -> int:
    return len(values["turn_bounds"]) // TURN_BOUND_FIELDS


def _on_last_turn(values: dict[str, Any], default: Any, last: Any) -> list:
    """Files written before trees held a turn's stop token, message count and digest only for the
    session's last turn (its header); earlier turns get `default` (they cannot be branched from)."""
    turns = _turns(values)
    return [default] * (turns - 1) + [last] if turns else []


def _older_keeps(values: dict[str, Any]) -> list:
    # A linear session: each turn kept its parent's whole path, which ended where the turn starts.
    bounds = values["turn_bounds"]
    return [bounds[i] for i in range(0, len(bounds), TURN_BOUND_FIELDS)]


_TENSORS: dict[str, _Tensor] = {
    "token_ids": _Tensor("input_ids", "i", np.int32),
    "loss_mask": _Tensor("loss_mask", "B", np.uint8),
    "logprobs": _Tensor("logprobs", "f", np.float32),
    "turn_bounds": _Tensor("turn_bounds", "i", np.int32, columns=TURN_BOUND_FIELDS),
    # Written before versions, weight updates mid-turn and temperatures were recorded: unknown, none.
    "turn_versions": _Tensor(
        "turn_versions",
        "i",
        np.int32,
        per_turn=True,
        older_files=lambda values: [UNKNOWN_VERSION] * _turns(values),
    ),
    "version_changes": _Tensor(
        "version_changes", "i", np.int32, columns=VERSION_CHANGE_FIELDS, older_files=lambda values: []
    ),
    "turn_temperatures": _Tensor(
        "turn_temperatures",
        "f",
        np.float32,
        per_turn=True,
        older_files=lambda values: [UNKNOWN_TEMPERATURE] * _turns(values),
    ),
    "turn_tempered": _Tensor(
        "turn_tempered", "B", np.uint8, per_turn=True, older_files=lambda values: [0] * _turns(values)
    ),
    # Written before trees: a linear session, no digests to branch or replay from but the last one.
    "turn_parents": _Tensor(
        "turn_parents",
        "i",
        np.int32,
        per_turn=True,
        older_files=lambda values: list(range(-1, _turns(values) - 1)),
    ),
    "turn_keeps": _Tensor("turn_keeps", "i", np.int32, per_turn=True, older_files=_older_keeps),
    "turn_calls": _Tensor(
        "turn_calls", "i", np.int32, per_turn=True, older_files=lambda values: list(range(_turns(values)))
    ),
    "turn_stop_tokens": _Tensor(
        "turn_stop_tokens",
        "i",
        np.int32,
        per_turn=True,
        older_files=lambda values: _on_last_turn(
            values,
            NO_STOP_TOKEN,
            NO_STOP_TOKEN if values["last_stop_token"] is None else values["last_stop_token"],
        ),
    ),
    "turn_message_counts": _Tensor(
        "turn_message_counts",
        "i",
        np.int32,
        per_turn=True,
        older_files=lambda values: _on_last_turn(values, 0, values["message_count"]),
    ),
    "turn_end_digests": _Tensor(
        "turn_end_digests",
        "B",
        np.uint8,
        columns=DIGEST_BYTES,
        per_turn=True,
        older_files=lambda values: [
            byte for digest in _on_last_turn(values, NO_DIGEST, values["history_digest"]) for byte in digest
        ],
    ),
    "turn_request_digests": _Tensor(
        "turn_request_digests",
        "B",
        np.uint8,
        columns=DIGEST_BYTES,
        per_turn=True,
        older_files=lambda values: [0] * (DIGEST_BYTES * _turns(values)),
    ),
    "turn_finishes": _Tensor(
        "turn_finishes",
        "B",
        np.uint8,
        per_turn=True,
        older_files=lambda values: [FINISH_UNKNOWN] * _turns(values),
    ),
    "turn_flags": _Tensor(
        "turn_flags", "B", np.uint8, per_turn=True, older_files=lambda values: [0] * _turns(values)
    ),
    "turn_created": _Tensor(
        "turn_created", "d", np.float64, per_turn=True, older_files=lambda values: [0.0] * _turns(values)
    ),
    # Written before images: none. The bytes are in the dump directory's images/ area, by sha256.
    "image_spans": _Tensor("image_spans", "i", np.int32, columns=IMAGE_FIELDS, older_files=lambda values: []),
    "image_digests": _Tensor(
        "image_digests", "B", np.uint8, columns=DIGEST_BYTES, older_files=lambda values: []
    ),
    # Written before routing replay: no turn stored routing. The rows are in the dump directory's
    # routing/ area (routing_store.py), one file per session.
    "turn_routed": _Tensor(
        "turn_routed", "B", np.uint8, per_turn=True, older_files=lambda values: [0] * _turns(values)
    ),
    "turn_routing_crcs": _Tensor(
        "turn_routing_crcs", "I", np.uint32, per_turn=True, older_files=lambda values: [0] * _turns(values)
    ),
}

_HEADER: dict[str, _HeaderValue] = {
    "session_id": _HeaderValue("session_id"),
    "key_digest": _HeaderValue("key_sha256", bytes.hex, bytes.fromhex),
    "created_at": _HeaderValue("created_at", decode=float),
    "metadata": _HeaderValue("metadata", decode=lambda value: dict(value or {}), older_files=dict),
    "message_count": _HeaderValue("message_count", decode=int),
    "history_digest": _HeaderValue("history_digest", bytes.hex, bytes.fromhex),
    "last_output_stopped": _HeaderValue("last_output_stopped", decode=bool),
    "last_stop_token": _HeaderValue("last_stop_token", older_files=lambda: None),
    "reward": _HeaderValue("reward", older_files=lambda: None),
    "turn_rewards": _HeaderValue(
        "turn_rewards",
        lambda rewards: {str(turn): value for turn, value in rewards.items()},
        lambda rewards: {int(turn): float(value) for turn, value in (rewards or {}).items()},
        older_files=dict,
    ),
    "finished": _HeaderValue("finished", decode=bool, older_files=lambda: False),
    "turn_stop_strings": _HeaderValue(
        "turn_stop_strings",
        lambda strings: {str(turn): value for turn, value in strings.items()},
        lambda strings: {int(turn): str(value) for turn, value in (strings or {}).items()},
        older_files=dict,
    ),
    "idempotency_keys": _HeaderValue(
        "idempotency_keys",
        decode=lambda keys: {str(key): int(call) for key, call in (keys or {}).items()},
        older_files=dict,
    ),
}


def _check_storage_covers_the_record() -> None:
    tensors, header = set(_TENSORS), set(_HEADER)
    missing = set(RECORD_FIELDS) - tensors - header
    extra = (tensors | header) - set(RECORD_FIELDS)
    if missing or extra or tensors & header:
        raise RuntimeError(
            f"the dump format and SessionRecord disagree: not stored {sorted(missing)}, "
            f"not on the record {sorted(extra)}, stored twice {sorted(tensors & header)}"
        )


_check_storage_covers_the_record()


def area_dir(dump_dir: Path, area: str) -> Path:
    return dump_dir / area


def probe_writable(dump_dir: Path) -> None:
    """Create the dump areas and write, sync and remove a small file (blocking); raises OSError when
    the volume cannot take writes (read-only, full, gone)."""
    for area in (LIVE_AREA, STALE_AREA, CORRUPT_AREA):
        area_dir(dump_dir, area).mkdir(parents=True, exist_ok=True)
    probe = area_dir(dump_dir, LIVE_AREA) / f".write-probe-{os.getpid()}"
    try:
        write_atomic(probe, b"probe" * 200)
    finally:
        probe.unlink(missing_ok=True)


def check_writable(dump_dir: Path) -> None:
    """Probe the dump directory, or raise: a proxy that cannot write its dumps must not start (it
    would serve, then lose every session at its first dump). A common cause: a hostPath directory
    created by the kubelet as root, the proxy running as non-root.
    """
    try:
        probe_writable(dump_dir)
    except OSError as exc:
        raise RuntimeError(
            f"the dump directory {dump_dir} is not writable ({exc}); sessions could not be saved, so the "
            f"proxy does not start. Make it writable for uid {os.getuid()} (gid {os.getgid()})."
        ) from exc


def dump_file_path(dump_dir: Path, area: str, session_id: str, stamp_ms: int | None = None) -> Path:
    """The file for a session (or batch: same id rule); refuses ids that could name anything outside
    the area directory."""
    if not is_valid_session_id(session_id):
        raise ValueError(f"invalid id {session_id!r}")
    name = session_id + (f".{stamp_ms}" if stamp_ms is not None else "") + SUFFIX
    directory = area_dir(dump_dir, area).resolve()
    path = (directory / name).resolve()
    if path.parent != directory:
        raise ValueError(f"session id {session_id!r} escapes the dump directory")
    return path


def encode_record(record: SessionRecord, reason: str) -> bytes:
    tensors: dict[str, np.ndarray] = {}
    for field_name, spec in _TENSORS.items():
        tensor: np.ndarray = np.frombuffer(getattr(record, field_name), dtype=spec.dtype)
        tensors[spec.name] = tensor.reshape(-1, spec.columns) if spec.columns > 1 else tensor
    header: dict[str, Any] = {"format": FORMAT, "format_version": FORMAT_VERSION, "reason": reason}
    header["dumped_at"] = time.time()
    for field_name, value in _HEADER.items():
        header[value.key] = value.encode(getattr(record, field_name))
    header["checksums"] = {name: zlib.crc32(t.tobytes()) for name, t in tensors.items()}
    return safetensors_save(tensors, metadata={FORMAT: orjson.dumps(header).decode()})


def write_atomic(path: Path, data: bytes) -> None:
    """Temp file in the same directory, fsync, rename, fsync the directory: all or nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_session_dump(dump_dir: Path, area: str, record: SessionRecord, reason: str) -> Path:
    """Serialize and write one session (blocking: call from a worker thread)."""
    stamp = int(time.time() * 1000) if area == STALE_AREA else None
    path = dump_file_path(dump_dir, area, record.session_id, stamp)
    write_atomic(path, encode_record(record, reason))
    return path


def write_batch_dump(dump_dir: Path, area: str, batch_id: str, data: bytes) -> Path:
    """Write an exported batch's bytes as they are (blocking: call from a worker thread). Expired
    batches get a time stamp in their name, like stale sessions; drained ones are named by id."""
    stamp = int(time.time() * 1000) if area == EXPORTED_AREA else None
    path = dump_file_path(dump_dir, area, batch_id, stamp)
    write_atomic(path, data)
    return path


def load_session_file(path: str | os.PathLike) -> SessionRecord:
    """Read a dump file back (the documented loader). Anything malformed raises DumpFormatError."""
    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open has no iter)
    except Exception as exc:
        raise DumpFormatError(f"{path}: not a readable safetensors file: {exc}") from exc
    if FORMAT not in meta:
        raise DumpFormatError(f"{path}: no {FORMAT} metadata")
    try:
        return _record_from(path, orjson.loads(meta[FORMAT]), tensors)
    except DumpFormatError:
        raise
    except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError) as exc:
        raise DumpFormatError(f"{path}: malformed {FORMAT} header: {type(exc).__name__}: {exc}") from None


def _record_from(path: str | os.PathLike, header: dict, tensors: dict[str, np.ndarray]) -> SessionRecord:
    if header.get("format") != FORMAT or header.get("format_version") not in READABLE_VERSIONS:
        raise DumpFormatError(
            f"{path}: unsupported format {header.get('format')} v{header.get('format_version')}"
        )
    if not isinstance(header.get("session_id"), str) or not is_valid_session_id(header["session_id"]):
        raise DumpFormatError(f"{path}: invalid session id {header.get('session_id')!r}")
    _verify_checksums(path, header, tensors)
    for spec in _TENSORS.values():
        if spec.older_files is None and spec.name not in tensors:
            raise DumpFormatError(f"{path}: no {spec.name} tensor")
    turns = tensors[_TENSORS["turn_bounds"].name].size // TURN_BOUND_FIELDS
    values: dict[str, Any] = {}
    for field_name, value in _HEADER.items():
        if value.key in header:
            values[field_name] = value.decode(header[value.key])
        elif value.older_files is not None:
            values[field_name] = value.older_files()
        else:
            raise DumpFormatError(f"{path}: no {value.key} in the header")
    for field_name, spec in _TENSORS.items():
        if spec.name in tensors:
            data = tensors[spec.name].astype(spec.dtype, copy=False).tobytes()
            values[field_name] = array(spec.typecode, data)
        else:
            values[field_name] = array(spec.typecode, spec.older_files(values))  # type: ignore[misc]
        if spec.per_turn and len(values[field_name]) != turns * spec.columns:
            raise DumpFormatError(f"{path}: {spec.name} do not match turn_bounds")
    record = SessionRecord(**values)
    _verify_shapes(path, record)
    _verify_values(path, tensors)
    return record


def _verify_shapes(path: str | os.PathLike, record: SessionRecord) -> None:
    token_ids, turn_bounds, version_changes = record.token_ids, record.turn_bounds, record.version_changes
    if len(version_changes) % VERSION_CHANGE_FIELDS or any(
        not 0 <= version_changes[i] < len(token_ids)
        for i in range(0, len(version_changes), VERSION_CHANGE_FIELDS)
    ):
        raise DumpFormatError(f"{path}: version_changes do not fit input_ids")
    if not len(token_ids) == len(record.loss_mask) == len(record.logprobs):
        raise DumpFormatError(f"{path}: input_ids, loss_mask and logprobs differ in length")
    if len(turn_bounds) % TURN_BOUND_FIELDS or any(b < 0 or b > len(token_ids) for b in turn_bounds):
        raise DumpFormatError(f"{path}: turn_bounds do not fit input_ids")
    if any(b > a for a, b in zip(turn_bounds[1:], turn_bounds, strict=False)):
        raise DumpFormatError(f"{path}: turn_bounds are not in order")
    problem = tree.shape_problem(record)
    if problem:
        raise DumpFormatError(f"{path}: {problem}")


def _verify_checksums(path: str | os.PathLike, header: dict, tensors: dict[str, np.ndarray]) -> None:
    checksums = header.get("checksums")
    if header["format_version"] < 2:
        return  # written before checksums
    if not isinstance(checksums, dict) or set(checksums) != set(tensors):
        raise DumpFormatError(f"{path}: checksums do not name exactly the tensors in the file")
    for name, tensor in tensors.items():
        if zlib.crc32(np.ascontiguousarray(tensor).tobytes()) != checksums[name]:
            raise DumpFormatError(f"{path}: tensor {name} fails its checksum")


def _verify_values(path: str | os.PathLike, tensors: dict[str, np.ndarray]) -> None:
    """Values a proxy never writes: a file holding them was altered, whatever its checksums say."""
    if tensors["input_ids"].size and int(tensors["input_ids"].min()) < 0:
        raise DumpFormatError(f"{path}: negative token ids")
    if tensors["loss_mask"].size and int(tensors["loss_mask"].max()) > 1:
        raise DumpFormatError(f"{path}: loss_mask values other than 0 and 1")
    logprobs = tensors["logprobs"]
    if logprobs.size and not bool(np.isfinite(logprobs).all()):
        raise DumpFormatError(f"{path}: logprobs that are not finite numbers")


def list_live_dumps(dump_dir: Path, area: str = LIVE_AREA) -> list[Path]:
    """The files a starting proxy restores from an area (`live/` sessions, `live-exports/` batches)."""
    directory = area_dir(dump_dir, area)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.name.endswith(SUFFIX) and not p.name.startswith("."))


def remove_other_dumps(dump_dir: Path, area: str, keep: set[str]) -> int:
    """Delete the area's files of sessions not in `keep` (blocking); returns how many."""
    removed = 0
    for path in list_live_dumps(dump_dir, area):
        if path.name[: -len(SUFFIX)] not in keep:
            path.unlink(missing_ok=True)
            removed += 1
    return removed


def quarantine(path: Path, dump_dir: Path) -> Path:
    """Move an unreadable file aside so it is kept for inspection but not retried forever."""
    target_dir = area_dir(dump_dir, CORRUPT_AREA)
    target_dir.mkdir(parents=True, exist_ok=True)
    target = target_dir / f"{path.name}.{int(time.time() * 1000)}"
    os.replace(path, target)
    return target
