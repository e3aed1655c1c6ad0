"""Dump files and stale-session cleanup against real files on disk."""

from __future__ import annotations

import asyncio
import os
import time
from array import array
from pathlib import Path

import numpy as np
import pytest
from rolloutfleet_proxy.cleanup import StaleSessionCleaner
from rolloutfleet_proxy.heap import HeapTrimmer
from rolloutfleet_proxy.ids import key_digest
from rolloutfleet_proxy.session import RecordedTurn, Session
from rolloutfleet_proxy.stats import Counters, Gauges
from rolloutfleet_proxy.storage import DumpStorage, NoStorage, Storage
from rolloutfleet_proxy.storage.dumps import (
    LIVE_AREA,
    STALE_AREA,
    DumpFormatError,
    dump_file_path,
    load_session_file,
    write_atomic,
    write_session_dump,
)
from rolloutfleet_proxy.storage.state_file import ProxyState
from rolloutfleet_proxy.store import SessionStore
from safetensors.numpy import load_file


def make_session(sid: str, turns: int = 2, idle_s: float = 0.0) -> Session:
    session = Session(sid, key_digest("key-" + sid), {"task": sid})
    for t in range(turns):
        session.append_turn(
            RecordedTurn(
                array("i", [t, t + 1]),
                array("i", [40 + t] * 3),
                array("f", [-0.25 * (t + 1)] * 3),
                message_count=2 * (t + 1),
                history_digest=bytes([t]) * 32,
                stopped=t % 2 == 0,
                stop_token=43 if t % 2 == 0 else None,
            ),
        )
    session.set_reward(2.0, None)
    session.last_active = time.monotonic() - idle_s
    return session


def test_dump_round_trip_and_any_safetensors_reader(tmp_path: Path):
    session = make_session("roundtrip-1")
    path = write_session_dump(tmp_path, LIVE_AREA, session.to_record(), "drain")
    assert path == tmp_path / LIVE_AREA / "roundtrip-1.safetensors"
    restored = Session.from_record(load_session_file(path))
    assert restored.trajectory() == session.trajectory() and restored.summary() == session.summary()
    assert restored.key_digest == session.key_digest and restored.history_digest == session.history_digest
    plain = load_file(str(path))  # a reader that knows nothing of this project
    assert plain["input_ids"].dtype == np.int32 and plain["turn_bounds"].shape == (2, 3)
    assert plain["loss_mask"].tolist() == session.loss_mask.tolist()


def test_stale_dumps_get_unique_names(tmp_path: Path):
    record = make_session("stale-name").to_record()
    first = write_session_dump(tmp_path, STALE_AREA, record, "stale")
    time.sleep(0.002)
    second = write_session_dump(tmp_path, STALE_AREA, record, "stale")
    assert first != second and first.exists() and second.exists()


@pytest.mark.parametrize("sid", ["../escape1", "..", "a/../../b", "/etc/passwd", "x" * 65])
def test_no_session_id_escapes_the_dump_directory(tmp_path: Path, sid: str):
    with pytest.raises(ValueError):
        dump_file_path(tmp_path, LIVE_AREA, sid)


def test_atomic_write_leaves_nothing_on_failure(tmp_path: Path, monkeypatch):
    target = tmp_path / "d" / "file.bin"
    write_atomic(target, b"old")

    def disk_full(_fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)  # the failure hits after the bytes were written
    with pytest.raises(OSError, match="No space"):
        write_atomic(target, b"new")
    assert target.read_bytes() == b"old"
    assert [p.name for p in target.parent.iterdir()] == ["file.bin"]


def test_loader_rejects_foreign_and_corrupt_files(tmp_path: Path):
    garbage = tmp_path / "g.safetensors"
    garbage.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(DumpFormatError):
        load_session_file(garbage)
    from safetensors.numpy import save_file

    foreign = tmp_path / "f.safetensors"
    save_file({"x": np.zeros(2, np.int32)}, str(foreign))
    with pytest.raises(DumpFormatError, match="metadata"):
        load_session_file(foreign)


@pytest.fixture
def counters() -> Counters:
    return Counters()


@pytest.fixture
async def dump_storage(tmp_path: Path, counters: Counters):
    """A dump directory's storage as a started proxy holds it: restored (from nothing), journal open."""
    storage = DumpStorage(
        tmp_path,
        counters,
        held_sessions=list,  # no compaction runs here
        state=ProxyState,
        durability="sync",
        journal_flush_interval_s=0.05,
        journal_compact_bytes=1 << 28,
        check_interval_s=5.0,
        write_concurrency=4,
        lost_capacity=100,
    )
    await storage.restore_sessions()
    yield storage
    await storage.close()


def make_cleaner(
    storage: Storage, store: SessionStore, counters: Counters, timeout_s: float = 10
) -> StaleSessionCleaner:
    return StaleSessionCleaner(
        store, storage, HeapTrimmer(), counters, Gauges(), timeout_s=timeout_s, interval_s=1
    )


async def test_cleanup_dumps_then_evicts_only_stale_idle_sessions(tmp_path: Path, counters, dump_storage):
    store = SessionStore()
    stale = [make_session(f"stale-{i:04d}", idle_s=60) for i in range(20)]
    fresh = make_session("fresh-0001", idle_s=1)
    busy = make_session("busy-00001", idle_s=60)
    for s in [*stale, fresh, busy]:
        store.add(s)
    await busy.lock.acquire()  # a turn in flight: never stale
    evicted = await make_cleaner(dump_storage, store, counters).run_once()
    assert evicted == 20 and len(store) == 2 and counters.sessions_dumped == 20
    files = sorted((tmp_path / STALE_AREA).iterdir())
    assert len(files) == 20
    by_id = {load_session_file(f).session_id: load_session_file(f) for f in files}
    for s in stale:
        assert by_id[s.session_id].token_ids == s.token_ids and by_id[s.session_id].reward == 2.0
    assert store.tokens_held == fresh.num_tokens + busy.num_tokens


async def test_failed_dump_write_loses_nothing_and_is_retried(tmp_path: Path, counters, dump_storage):
    store = SessionStore()
    sessions = [make_session(f"keepme-{i:03d}", idle_s=60) for i in range(5)]
    for s in sessions:
        store.add(s)
    # Running as root, permissions do not stop writes: put a file where the stale/ directory belongs.
    (tmp_path / STALE_AREA).write_text("not a directory")
    cleaner = make_cleaner(dump_storage, store, counters)
    assert await cleaner.run_once() == 0
    assert counters.dump_failures == 5 and len(store) == 5
    for s in sessions:
        assert store.get(s.session_id) is s and s.num_tokens == 10  # intact and reachable again
    os.remove(tmp_path / STALE_AREA)
    assert await cleaner.run_once() == 5 and len(store) == 0
    assert len(list((tmp_path / STALE_AREA).iterdir())) == 5


async def test_cleanup_during_turn_waits_for_the_turn(tmp_path: Path, counters, dump_storage):
    """A session in a turn is not detached; once the turn ends and it idles, it is dumped whole."""
    store = SessionStore()
    session = make_session("turning-01", turns=1, idle_s=60)
    store.add(session)
    cleaner = make_cleaner(dump_storage, store, counters, timeout_s=0.05)
    async with session.lock:
        assert await cleaner.run_once() == 0
        session.append_turn(
            RecordedTurn(
                array("i", [9]),
                array("i", [8]),
                array("f", [-1.0]),
                message_count=4,
                history_digest=b"\x02" * 32,
                stopped=False,
                stop_token=None,
            ),
        )
        session.touch()
    await asyncio.sleep(0.1)
    assert await cleaner.run_once() == 1
    (path,) = (tmp_path / STALE_AREA).iterdir()
    assert load_session_file(path).token_ids.tolist() == session.token_ids.tolist()
    assert len(load_session_file(path).token_ids) == 7


async def test_dropping_without_dump_dir_only_when_chosen():
    store, counters = SessionStore(), Counters()
    store.add(make_session("dropme-001", idle_s=60))
    assert await make_cleaner(NoStorage(counters), store, counters).run_once() == 1
    assert counters.sessions_dropped == 1 and len(store) == 0


async def test_cleanup_trims_the_heap_after_deletions_too():
    store, counters = SessionStore(), Counters()
    calls = []
    cleaner = StaleSessionCleaner(
        store,
        NoStorage(counters),
        HeapTrimmer(trim_fn=calls.append),
        counters,
        Gauges(),
        timeout_s=10,
        interval_s=1,
    )
    await cleaner.run_once()
    assert calls == []  # nothing left memory: no trim
    store.add(make_session("deleted-01"))
    store.remove("deleted-01", "deleted by the client")
    counters.sessions_evicted += 1  # as the DELETE route counts it
    await cleaner.run_once()
    await cleaner.run_once()
    assert calls == [0] and counters.heap_trims == 1


async def test_cleanup_loop_survives_a_failing_cycle(tmp_path: Path):
    from rolloutfleet_proxy.runtime import ProxyRuntime
    from rolloutfleet_proxy.settings import ProxySettings

    settings = ProxySettings(
        upstream_url="http://127.0.0.1:1",
        tokenizer_path="/unused",
        admin_key="k",
        dump_dir=tmp_path,
        cleanup_interval_s=0.01,
    )
    runtime = ProxyRuntime(settings)
    calls = []

    async def flaky_cycle() -> int:
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise RuntimeError("disk vanished")
        return 0

    runtime.cleaner.run_once = flaky_cycle
    loop_task = asyncio.create_task(runtime.background["stale-session-cleanup"].run())
    for _ in range(200):
        if len(calls) >= 3:
            break
        await asyncio.sleep(0.01)
    loop_task.cancel()
    assert len(calls) >= 3 and runtime.counters.cleanup_errors == 1
