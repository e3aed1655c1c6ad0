"""Restore at start, after any stop, clean or not: what a predecessor left in the dump directory.

In this order: the state file (model version, pause, admission counters); the sessions (the snapshots
in `live/`, then the journal replayed over them: `recover`); the export batches in `live-exports/`.
The reading runs in worker threads, before the proxy serves. Nothing read is deleted here: the
snapshots and segments stay until a compaction has made what they hold durable again, and a batch's
file until the trainer acknowledges the batch, so a kill during or right after a restore loses
nothing either. Files that fail verification are moved to `corrupt/` (never served, never
overwritten); sessions whose state cannot be rebuilt exactly are reported as lost, so clients get 410
`session_lost` rather than a wrong trajectory.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson
from rolloutfleet_wire.export_format import decode_batch
from rolloutfleet_wire.routed_experts import RoutingError, RoutingShape

from ..export_buffer import ExportBatch
from ..ids import is_valid_session_id
from ..session import Session
from ..stats import Counters
from .dumps import (
    LIVE_AREA,
    LIVE_EXPORTS_AREA,
    SUFFIX,
    DumpFormatError,
    list_live_dumps,
    load_session_file,
    quarantine,
    write_atomic,
)
from .journal import journal_dir, list_segments
from .journal_records import CREATE, END, FINISH, REWARD, TURN, Record, incarnation, recorded_turn, scan
from .routing_store import ROUTING_AREA, RoutingRestore, drop_routing, routing_key
from .state_file import ProxyState, StateFormatError, read_state, state_path

log = logging.getLogger("rolloutfleet.proxy.recovery")
start_log = logging.getLogger("rolloutfleet.proxy")  # what the start-up reports
batch_log = logging.getLogger("rolloutfleet.proxy.exports")

LOST_FILE = "lost-sessions.json"


@dataclass
class Recovered:
    sessions: dict[str, Session] = field(default_factory=dict)
    lost: dict[str, str] = field(default_factory=dict)  # session id -> why it could not be recovered
    snapshots: int = 0
    records: int = 0  # journal records applied
    segments: int = 0
    last_seq: int = 0
    quarantined: list[str] = field(default_factory=list)  # what went to corrupt/, as moved
    damaged_segments: int = 0
    seconds: float = 0.0
    routing_sizes: dict[str, int] = field(default_factory=dict)  # routing bytes per session key


class Replay:
    """Applies journal records, in order, to sessions (no I/O but through `routing`, which rebuilds
    the routing replay files from the turns' rows)."""

    def __init__(
        self, sessions: dict[str, Session], lost: dict[str, str], routing: RoutingRestore | None = None
    ):
        self.sessions = sessions
        self.lost = lost
        self.routing = routing
        self.applied = 0
        self._lost_incarnations: dict[str, str] = {}
        self._orphans: dict[str, str] = {}  # records seen without their session: id -> incarnation

    def apply(self, record: Record) -> None:
        sid, inc = record.session_id, record.incarnation
        if record.kind == CREATE:
            existing = self.sessions.get(sid)
            # The same incarnation: already restored. Another: the old one ended (its end was compacted).
            if existing is None or incarnation(existing.key_digest) != inc:
                key = bytes.fromhex(record.header["key"])
                self.sessions[sid] = Session(
                    sid, key, dict(record.header.get("metadata") or {}), float(record.header["created_at"])
                )
                if self.routing is not None:
                    self.routing.reset(routing_key(sid, key))
                self.lost.pop(sid, None)
                self._orphans.pop(sid, None)
                self.applied += 1
            return
        session = self.sessions.get(sid)
        if session is None or incarnation(session.key_digest) != inc:
            if record.kind == END:  # it ended: nothing to recover, nobody waiting for it
                self._orphans.pop(sid, None)
                if self._lost_incarnations.get(sid) == inc:
                    self.lost.pop(sid, None)
            elif self._lost_incarnations.get(sid) != inc:
                self._orphans[sid] = inc
            return
        if record.kind == TURN:
            self._turn(session, record)
        elif record.kind == REWARD:
            turn = record.header.get("turn")
            session.set_reward(float(record.header["value"]), None if turn is None else int(turn))
        elif record.kind == FINISH:
            session.finished = True
        elif record.kind == END:
            del self.sessions[sid]
        self.applied += 1

    def _turn(self, session: Session, record: Record) -> None:
        h, body = record.header, record.turn
        assert body is not None
        index = int(h["turn"])
        if index < session.num_turns:
            return  # already in the snapshot
        if index > session.num_turns:
            self._lose(session, f"turn {session.num_turns} is missing from the journal (next is {index})")
            return
        problem = _implausible(body)
        if problem:
            self._lose(session, f"turn {index} holds {problem}")
            return
        try:
            session.append_turn(recorded_turn(record))
            session.committed_turns = session.num_turns  # journaled, so durable: it may be replayed
        except (KeyError, TypeError, ValueError) as exc:
            self._lose(session, f"turn {index} cannot be applied: {exc}")
            return
        if body.routing is not None and self.routing is not None:
            try:
                self.routing.append(routing_key(session.session_id, session.key_digest), body.routing)
            except (OSError, RoutingError) as exc:
                self._lose(session, f"the routing of turn {index} cannot be kept: {exc}")

    def _lose(self, session: Session, why: str) -> None:
        del self.sessions[session.session_id]
        self.lost[session.session_id] = why
        self._lost_incarnations[session.session_id] = incarnation(session.key_digest)

    def finish(self) -> None:
        """Sessions the journal changed but whose start was not recoverable, and that never ended."""
        for sid in self._orphans:
            if sid not in self.sessions:
                self.lost.setdefault(sid, "its start is in no snapshot or journal record that survived")


def _implausible(body) -> str | None:
    """Values a proxy never journals (the CRC catches damage; this catches anything else)."""
    for ids in (body.new_input_ids, body.output_ids):
        if ids and int(np.frombuffer(ids, dtype=np.int32).min()) < 0:
            return "negative token ids"
    if body.output_logprobs and not bool(
        np.isfinite(np.frombuffer(body.output_logprobs, dtype=np.float32)).all()
    ):
        return "logprobs that are not finite numbers"
    return None


async def restore_state(dump_dir: Path, counters: Counters) -> ProxyState | None:
    """The model version, the pause and the counters a predecessor saved; None when there are none."""
    try:
        return await asyncio.to_thread(read_state, dump_dir)
    except (OSError, StateFormatError) as exc:
        # Starting at version 0 is safe: the trainer's next version is then a jump, and rebases.
        counters.restore_failures += 1
        target = await asyncio.to_thread(quarantine, state_path(dump_dir), dump_dir)
        start_log.error("cannot read the state file (%s); kept as %s; starting at version 0", exc, target)
        return None


async def restore_sessions(
    dump_dir: Path, lost_capacity: int, counters: Counters, routing_shape: RoutingShape | None = None
) -> Recovered:
    """Every session a predecessor held: its snapshots in `live/`, then its journal replayed over them
    (after a SIGKILL as after a drain), with their routing replay files rebuilt to match."""
    start_log.info("restoring from %s", dump_dir)
    recovered = await asyncio.to_thread(recover, dump_dir, lost_capacity, routing_shape)
    counters.sessions_restored += len(recovered.sessions)
    counters.sessions_lost += len(recovered.lost)
    counters.restore_failures += len(recovered.quarantined)
    start_log.info(
        "restored",
        extra={
            "fields": {
                "sessions": len(recovered.sessions),
                "snapshots": recovered.snapshots,
                "journal_segments": recovered.segments,
                "journal_records": recovered.records,
                "lost": len(recovered.lost),
                "quarantined": recovered.quarantined,
                "seconds": round(recovered.seconds, 3),
            }
        },
    )
    return recovered


def recover(
    dump_dir: Path, lost_capacity: int = 10000, routing_shape: RoutingShape | None = None
) -> Recovered:
    """`restore_sessions`, blocking."""
    started = time.monotonic()
    result = Recovered()
    result.lost.update(_read_lost(dump_dir))
    unreadable: set[str] = set()
    # Routing replay off: rows recorded before are dropped (the turns keep their tokens), not lost.
    routing = None if routing_shape is None else RoutingRestore(dump_dir / ROUTING_AREA, routing_shape)
    for path in list_live_dumps(dump_dir, LIVE_AREA):
        name = path.name[: -len(SUFFIX)]
        try:
            record = load_session_file(path)
            if record.session_id != name:
                raise DumpFormatError(f"{path}: holds session {record.session_id!r}, not {name!r}")
        except Exception as exc:  # whatever is wrong with one file must not stop the others
            target = quarantine(path, dump_dir)
            result.quarantined.append(str(target))
            log.error("cannot restore %s (%s); moved to %s", path, exc, target)
            if is_valid_session_id(name):
                unreadable.add(name)
            continue
        try:
            problem = None if routing is None else routing.from_snapshot(record)
        except OSError as exc:
            problem = f"its routing file cannot be cut back ({exc})"
        if problem:
            log.error("cannot restore session %s: %s", name, problem)
            result.lost[name] = problem
            continue
        result.sessions[name] = Session.from_record(record)
        result.snapshots += 1
    replay = Replay(result.sessions, result.lost, routing)
    for seq, path in list_segments(journal_dir(dump_dir)):
        result.last_seq = seq
        result.segments += 1
        scanned = _scan_file(path)
        if scanned.damaged:
            result.damaged_segments += 1
            target = _copy_aside(path, dump_dir)
            result.quarantined.append(str(target))
            log.error(
                "journal segment %s is damaged (%d bytes unreadable); its intact records were replayed; "
                "a copy is kept as %s",
                path,
                scanned.skipped_bytes,
                target,
            )
        for record in scanned.records:
            replay.apply(record)
        del scanned
    replay.finish()
    if routing is None:
        drop_routing(dump_dir / ROUTING_AREA, result.sessions.values())
    else:
        for sid, problem in routing.finish(result.sessions).items():
            log.error("cannot restore session %s: %s", sid, problem)
            del result.sessions[sid]
            result.lost[sid] = problem
        result.routing_sizes = routing.sizes
    for sid in unreadable:
        if sid not in result.sessions:
            result.lost.setdefault(sid, "its snapshot failed verification")
    for sid in result.sessions:
        result.lost.pop(sid, None)
    if len(result.lost) > lost_capacity:
        result.lost = dict(list(result.lost.items())[-lost_capacity:])
    result.records = replay.applied
    if result.lost or (dump_dir / LOST_FILE).exists():
        write_atomic(dump_dir / LOST_FILE, orjson.dumps(result.lost))
    result.seconds = time.monotonic() - started
    return result


def _scan_file(path: Path):
    """Scan a segment through a read-only mapping: a segment can be as large as the compaction
    threshold, and reading it whole would hold all of it in the heap at once."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return scan(b"")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return scan(data)  # records copy what they keep: nothing refers to the mapping after


def _read_lost(dump_dir: Path) -> dict[str, str]:
    try:
        raw = orjson.loads((dump_dir / LOST_FILE).read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return {}
    if not isinstance(raw, dict):
        return {}
    return {
        k: v for k, v in raw.items() if isinstance(k, str) and isinstance(v, str) and is_valid_session_id(k)
    }


def _copy_aside(path: Path, dump_dir: Path) -> Path:
    """A copy of a damaged segment in corrupt/, for inspection; the segment itself stays until a
    compaction retires it (its intact records are still the only copy of some changes)."""
    target = dump_dir / "corrupt" / f"{path.name}.{int(time.time() * 1000)}"
    target.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(target, path.read_bytes())
    return target


async def restore_batches(dump_dir: Path, ttl_s: float, counters: Counters) -> list[ExportBatch]:
    """The batches a predecessor held, each with a fresh TTL. Their files stay until acknowledged (a
    second kill loses nothing)."""
    restored: dict[str, ExportBatch] = {}
    for path in await asyncio.to_thread(list_live_dumps, dump_dir, LIVE_EXPORTS_AREA):
        try:
            data = await asyncio.to_thread(path.read_bytes)
            decoded = await asyncio.to_thread(decode_batch, data)
        except Exception as exc:
            counters.restore_failures += 1
            target = await asyncio.to_thread(quarantine, path, dump_dir)
            batch_log.error("cannot restore export batch %s (%s); kept as %s", path, exc, target)
            continue
        if decoded.batch_id in restored:
            counters.restore_failures += 1
            batch_log.error(
                "cannot restore %s: batch %s is already held; the file is kept", path, decoded.batch_id
            )
            continue
        restored[decoded.batch_id] = ExportBatch(
            batch_id=decoded.batch_id,
            data=data,
            session_ids=[t["session_id"] for t in decoded.header["trajectories"]],
            num_tokens=len(decoded.tensors["input_ids"]),
            created_at=float(decoded.header.get("created_at", time.time())),
            expires_at=time.monotonic() + ttl_s,
            image_digests=decoded.image_digest_set(),
        )
        del decoded
        counters.batches_restored += 1
    return list(restored.values())
