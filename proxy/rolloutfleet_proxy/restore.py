"""Start-up recovery: the state file, then every session a predecessor held (its `live/` snapshots
with its journal replayed over them), put back into the running parts."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from .dumps import quarantine
from .generation import GenerationControl
from .heap import HeapTrimmer
from .journal import Journal
from .recovery import recover
from .state_file import StateFormatError, read_state, state_path
from .stats import AdmissionCounters, Counters
from .store import SessionStore

log = logging.getLogger("rolloutfleet.proxy")


async def restore_state(
    dump_dir: Path, generation: GenerationControl, admission: AdmissionCounters, counters: Counters
) -> None:
    """Recover the model version, the pause and the counters a predecessor saved."""
    try:
        state = await asyncio.to_thread(read_state, dump_dir)
    except (OSError, StateFormatError) as exc:
        # Starting at version 0 is safe: the trainer's next version is then a jump, and rebases.
        counters.restore_failures += 1
        target = await asyncio.to_thread(quarantine, state_path(dump_dir), dump_dir)
        log.error("cannot read the state file (%s); kept as %s; starting at version 0", exc, target)
        return
    if state is None:
        return
    generation.model_version = state.model_version
    if state.paused:
        generation.pause()
    admission.enqueued = state.enqueued
    admission.accepted = state.accepted  # rebased once the sessions are restored
    admission.rejected = state.rejected
    admission.refused = state.refused


async def restore_sessions(
    dump_dir: Path,
    tombstone_capacity: int,
    store: SessionStore,
    journal: Journal,
    counters: Counters,
    trimmer: HeapTrimmer,
) -> None:
    """Bring back every session a predecessor held: its snapshots in `live/`, then its journal
    replayed over them (after a SIGKILL as after a drain). Nothing read is deleted here."""
    log.info("restoring from %s", dump_dir)
    recovered = await asyncio.to_thread(recover, dump_dir, tombstone_capacity)
    for session in recovered.sessions.values():
        store.add(session)
    for session_id, why in recovered.lost.items():
        store.mark_lost(session_id, why)
    counters.sessions_restored += len(recovered.sessions)
    counters.sessions_lost += len(recovered.lost)
    counters.restore_failures += len(recovered.quarantined)
    await journal.open(recovered.last_seq)
    log.info(
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
    del recovered
    if trimmer.available:  # the replay grew arrays step by step: give the slack back
        await asyncio.to_thread(trimmer.trim)
