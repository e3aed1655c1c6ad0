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
version mid-turn), `turn_temperatures` (float32) and `turn_tempered` (uint8), and under the
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
from pathlib import Path

import numpy as np
import orjson
from rolloutfleet_wire.session_record import (
    TURN_BOUND_FIELDS,
    UNKNOWN_TEMPERATURE,
    UNKNOWN_VERSION,
    VERSION_CHANGE_FIELDS,
    SessionRecord,
)
from safetensors import safe_open
from safetensors.numpy import save as safetensors_save

from .ids import is_valid_session_id

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
    tensors: dict[str, np.ndarray] = {
        "input_ids": np.frombuffer(record.token_ids, dtype=np.int32),
        "loss_mask": np.frombuffer(record.loss_mask, dtype=np.uint8),
        "logprobs": np.frombuffer(record.logprobs, dtype=np.float32),
        "turn_bounds": np.frombuffer(record.turn_bounds, dtype=np.int32).reshape(-1, TURN_BOUND_FIELDS),
        "turn_versions": np.frombuffer(record.turn_versions, dtype=np.int32),
        "version_changes": np.frombuffer(record.version_changes, dtype=np.int32).reshape(
            -1, VERSION_CHANGE_FIELDS
        ),
        "turn_temperatures": np.frombuffer(record.turn_temperatures, dtype=np.float32),
        "turn_tempered": np.frombuffer(record.turn_tempered, dtype=np.uint8),
    }
    header = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "reason": reason,
        "dumped_at": time.time(),
        "session_id": record.session_id,
        "key_sha256": record.key_digest.hex(),
        "created_at": record.created_at,
        "metadata": record.metadata,
        "message_count": record.message_count,
        "history_digest": record.history_digest.hex(),
        "last_output_stopped": record.last_output_stopped,
        "last_stop_token": record.last_stop_token,
        "reward": record.reward,
        "turn_rewards": {str(k): v for k, v in record.turn_rewards.items()},
        "finished": record.finished,
        "checksums": {name: zlib.crc32(t.tobytes()) for name, t in tensors.items()},
    }
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
    token_ids = array("i", tensors["input_ids"].astype(np.int32, copy=False).tobytes())
    loss_mask = array("B", tensors["loss_mask"].astype(np.uint8, copy=False).tobytes())
    logprobs = array("f", tensors["logprobs"].astype(np.float32, copy=False).tobytes())
    turn_bounds = array("i", tensors["turn_bounds"].astype(np.int32, copy=False).tobytes())
    turns = len(turn_bounds) // TURN_BOUND_FIELDS
    if "turn_versions" in tensors:
        turn_versions = array("i", tensors["turn_versions"].astype(np.int32, copy=False).tobytes())
    else:  # written before versions were recorded
        turn_versions = array("i", [UNKNOWN_VERSION] * turns)
    if len(turn_versions) != turns:
        raise DumpFormatError(f"{path}: turn_versions do not match turn_bounds")
    # Written before weight versions mid-turn and temperatures were recorded: none / unknown.
    version_changes = _tensor_array(tensors, "version_changes", "i", np.int32, [])
    turn_temperatures = _tensor_array(
        tensors, "turn_temperatures", "f", np.float32, [UNKNOWN_TEMPERATURE] * turns
    )
    turn_tempered = _tensor_array(tensors, "turn_tempered", "B", np.uint8, [0] * turns)
    if len(turn_temperatures) != turns or len(turn_tempered) != turns:
        raise DumpFormatError(f"{path}: turn_temperatures or turn_tempered do not match turn_bounds")
    if len(version_changes) % VERSION_CHANGE_FIELDS or any(
        not 0 <= version_changes[i] < len(token_ids)
        for i in range(0, len(version_changes), VERSION_CHANGE_FIELDS)
    ):
        raise DumpFormatError(f"{path}: version_changes do not fit input_ids")
    if not len(token_ids) == len(loss_mask) == len(logprobs):
        raise DumpFormatError(f"{path}: input_ids, loss_mask and logprobs differ in length")
    if len(turn_bounds) % TURN_BOUND_FIELDS or any(b < 0 or b > len(token_ids) for b in turn_bounds):
        raise DumpFormatError(f"{path}: turn_bounds do not fit input_ids")
    if any(b > a for a, b in zip(turn_bounds[1:], turn_bounds, strict=False)):
        raise DumpFormatError(f"{path}: turn_bounds are not in order")
    _verify_values(path, tensors)
    return SessionRecord(
        session_id=header["session_id"],
        key_digest=bytes.fromhex(header["key_sha256"]),
        created_at=float(header["created_at"]),
        metadata=dict(header.get("metadata") or {}),
        token_ids=token_ids,
        loss_mask=loss_mask,
        logprobs=logprobs,
        turn_bounds=turn_bounds,
        turn_versions=turn_versions,
        version_changes=version_changes,
        turn_temperatures=turn_temperatures,
        turn_tempered=turn_tempered,
        message_count=int(header["message_count"]),
        history_digest=bytes.fromhex(header["history_digest"]),
        last_output_stopped=bool(header["last_output_stopped"]),
        last_stop_token=header.get("last_stop_token"),
        reward=header.get("reward"),
        turn_rewards={int(k): float(v) for k, v in (header.get("turn_rewards") or {}).items()},
        finished=bool(header.get("finished", False)),
    )


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


def _tensor_array(
    tensors: dict[str, np.ndarray], name: str, typecode: str, dtype: type, default: list
) -> array:
    if name not in tensors:
        return array(typecode, default)
    return array(typecode, tensors[name].astype(dtype, copy=False).tobytes())


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
