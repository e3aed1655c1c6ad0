"""The write-ahead journal: record framing, torn and damaged segments, replay rules, group commit,
and restore = snapshots + replay on real files."""

from __future__ import annotations

import asyncio
import math
from array import array
from pathlib import Path

import pytest
from rolloutfleet_proxy.errors import http_error
from rolloutfleet_proxy.failures import StorageUnavailable
from rolloutfleet_proxy.ids import key_digest
from rolloutfleet_proxy.session import RecordedTurn, Session
from rolloutfleet_proxy.storage import journal_records as jr
from rolloutfleet_proxy.storage.dumps import LIVE_AREA, load_session_file, write_session_dump
from rolloutfleet_proxy.storage.health import StorageHealth
from rolloutfleet_proxy.storage.journal import Journal, journal_dir, list_segments
from rolloutfleet_proxy.storage.restore import Replay, recover

KEY = key_digest("key-a")
OTHER_KEY = key_digest("key-b")


def turn(sid: str, index: int, key: bytes = KEY, n_in: int = 3, n_out: int = 2, base: int = 10) -> bytes:
    return jr.turn_record(
        sid,
        key,
        index,
        RecordedTurn(
            array("i", range(base, base + n_in)),
            array("i", range(base + 100, base + 100 + n_out)),
            array("f", [-0.5 - i for i in range(n_out)]),
            message_count=2 * (index + 1),
            history_digest=bytes([index]) * 32,
            stopped=True,
            stop_token=base + 100 + n_out - 1,
            model_version=index,
            version_changes=[(1, index + 1)] if n_out > 1 else [],
            temperature=0.7,
            tempered=True,
        ),
    )


def segment_of(*records: bytes) -> bytes:
    return b"".join(records)


def test_records_round_trip_every_kind():
    data = segment_of(
        jr.create_record("session-a1", KEY, 12.5, {"task": "t"}),
        turn("session-a1", 0),
        jr.reward_record("session-a1", KEY, 1.5, None),
        jr.finish_record("session-a1", KEY),
        jr.end_record("session-a1", KEY, "deleted"),
    )
    scanned = jr.scan(data)
    assert [r.kind for r in scanned.records] == [jr.CREATE, jr.TURN, jr.REWARD, jr.FINISH, jr.END]
    assert scanned.good_bytes == len(data) and not scanned.damaged and scanned.skipped_bytes == 0
    body = scanned.records[1].turn
    assert body.new_input_ids.tolist() == [10, 11, 12] and body.output_ids.tolist() == [110, 111]
    assert body.output_logprobs.tolist() == [-0.5, -1.5]
    assert (
        scanned.records[1].header["changes"] == [[1, 1]] and scanned.records[1].header["temperature"] == 0.7
    )
    assert scanned.records[0].header["metadata"] == {"task": "t"}


def test_a_torn_last_record_at_every_byte_offset_loses_only_that_record():
    before = [jr.create_record("session-a1", KEY, 1.0, {}), turn("session-a1", 0), turn("session-a1", 1)]
    last = turn("session-a1", 2, n_in=5, n_out=4)
    prefix = segment_of(*before)
    for cut in range(len(last)):  # every byte offset of the last record, 0 (nothing of it) included
        scanned = jr.scan(prefix + last[:cut])
        assert len(scanned.records) == 3, cut
        assert scanned.good_bytes == len(prefix) and not scanned.damaged, cut
    assert len(jr.scan(prefix + last).records) == 4


def test_a_flipped_byte_in_the_middle_is_damage_and_the_scan_resynchronises():
    records = [jr.create_record("session-a1", KEY, 1.0, {})] + [turn("session-a1", i) for i in range(4)]
    data = bytearray(segment_of(*records))
    second_turn_start = len(records[0]) + len(records[1])
    data[second_turn_start + jr.FRAME_BYTES + 7] ^= 0xFF  # inside turn 1's payload: its CRC fails
    scanned = jr.scan(bytes(data))
    assert scanned.damaged and scanned.skipped_bytes == len(records[2])
    assert [r.header.get("turn") for r in scanned.records] == [None, 0, 2, 3]


def replay(records: list[bytes], sessions: dict | None = None) -> Replay:
    replayer = Replay(sessions if sessions is not None else {}, {})
    for record in jr.scan(segment_of(*records)).records:
        replayer.apply(record)
    replayer.finish()
    return replayer


def test_replay_rebuilds_a_session_exactly_as_the_live_one():
    live = Session("session-a1", KEY, {"task": "t"}, created_at=3.0)
    records = [jr.create_record("session-a1", KEY, 3.0, {"task": "t"})]
    for i in range(3):
        record = turn("session-a1", i, base=20 * i)
        body = jr.scan(record).records[0]
        live.append_turn(
            RecordedTurn(
                body.turn.new_input_ids,
                body.turn.output_ids,
                body.turn.output_logprobs,
                message_count=2 * (i + 1),
                history_digest=bytes([i]) * 32,
                stopped=True,
                stop_token=body.turn.output_ids[-1],
                model_version=i,
                version_changes=[(1, i + 1)],
                temperature=0.7,
                tempered=True,
            ),
        )
        records.append(record)
    live.set_reward(0.25, 1)
    live.finished = True
    records += [jr.reward_record("session-a1", KEY, 0.25, 1), jr.finish_record("session-a1", KEY)]
    rebuilt = replay(records).sessions["session-a1"]
    assert rebuilt.copied_record() == live.copied_record() or _same(rebuilt, live)


def _same(a: Session, b: Session) -> bool:
    ra, rb = a.copied_record(), b.copied_record()
    for name in ra.__dataclass_fields__:
        va, vb = getattr(ra, name), getattr(rb, name)
        if name == "turn_temperatures":
            assert [round(x, 5) for x in va] == [round(x, 5) for x in vb]
        elif not (isinstance(va, float) and math.isnan(va)):
            assert va == vb, name
    return True


def test_replay_over_a_newer_snapshot_is_a_no_op_for_what_it_holds():
    records = [jr.create_record("session-a1", KEY, 1.0, {})] + [turn("session-a1", i) for i in range(3)]
    full = replay(records).sessions["session-a1"]
    snapshot = Session.from_record(full.copied_record())
    again = replay(records, {"session-a1": snapshot}).sessions["session-a1"]
    assert again.num_turns == 3 and again.token_ids == full.token_ids


def test_a_reused_id_never_takes_the_records_of_its_predecessor():
    records = [
        jr.create_record("session-a1", KEY, 1.0, {}),
        turn("session-a1", 0),
        jr.end_record("session-a1", KEY, "deleted"),
        jr.create_record("session-a1", OTHER_KEY, 2.0, {}),
        turn("session-a1", 0, key=OTHER_KEY, base=50),
    ]
    result = replay(records)
    session = result.sessions["session-a1"]
    assert session.key_digest == OTHER_KEY and session.token_ids[0] == 50 and not result.lost


def test_a_missing_turn_makes_the_session_lost_not_wrong():
    records = [jr.create_record("session-a1", KEY, 1.0, {}), turn("session-a1", 0), turn("session-a1", 2)]
    result = replay(records)
    assert "session-a1" not in result.sessions and "turn 1 is missing" in result.lost["session-a1"]


def test_a_turn_with_values_a_proxy_never_writes_makes_the_session_lost():
    bad = jr.turn_record(
        "session-a1",
        KEY,
        0,
        RecordedTurn(
            array("i", [1, 2]),
            array("i", [3]),
            array("f", [float("nan")]),
            message_count=2,
            history_digest=bytes(32),
            stopped=False,
            stop_token=None,
            model_version=0,
            version_changes=[],
            temperature=1.0,
            tempered=True,
        ),
    )
    result = replay([jr.create_record("session-a1", KEY, 1.0, {}), bad])
    assert not result.sessions and "not finite" in result.lost["session-a1"]


def test_records_without_their_start_are_lost_unless_the_session_ended():
    ended = replay([turn("session-e1", 4), jr.end_record("session-e1", KEY, "exported")])
    assert not ended.sessions and not ended.lost
    orphan = replay([turn("session-o1", 4)])
    assert not orphan.sessions and "session-o1" in orphan.lost


async def test_group_commit_shares_syncs_and_files_hold_every_record(tmp_path):
    health = StorageHealth()
    journal = Journal(journal_dir(tmp_path), health)
    await journal.open(0)
    records = [jr.create_record(f"session-{i:04d}", KEY, 1.0, {}) for i in range(200)]
    await asyncio.gather(*(journal.write(r) for r in records))
    await journal.close()
    assert journal.stats.syncs < 200  # committed in groups, not one fsync each
    ((seq, path),) = list_segments(journal_dir(tmp_path))
    assert seq == 1 and path.read_bytes() == b"".join(records)


async def test_a_failed_write_refuses_commits_and_appends_until_storage_recovers(tmp_path):
    health = StorageHealth()
    journal = Journal(journal_dir(tmp_path), health)
    await journal.open(0)
    await journal.write(jr.create_record("session-a1", KEY, 1.0, {}))
    # The segment's directory disappears (as a volume does): the next new segment cannot be created.
    journal.rotate()
    for _, path in list_segments(journal_dir(tmp_path)):
        path.unlink()
    journal_dir(tmp_path).rmdir()
    with pytest.raises(StorageUnavailable) as failed:
        await journal.write(jr.create_record("session-b1", KEY, 1.0, {}))
    answer = http_error(failed.value)
    assert answer.status == 503 and answer.code == "storage_unavailable" and answer.headers["Retry-After"]
    assert not health.ok and "journal write failed" in health.reason
    with pytest.raises(StorageUnavailable):
        journal.append(jr.create_record("session-c1", KEY, 1.0, {}))
    journal_dir(tmp_path).mkdir()
    health.recover()
    await journal.write(jr.create_record("session-d1", KEY, 1.0, {}))
    await journal.close()
    ids = [
        r.session_id for _, p in list_segments(journal_dir(tmp_path)) for r in jr.scan(p.read_bytes()).records
    ]
    assert ids == ["session-d1"]


def _snapshot(dump_dir: Path, sid: str, turns: int) -> None:
    records = [jr.create_record(sid, KEY, 1.0, {})] + [turn(sid, i) for i in range(turns)]
    session = replay(records).sessions[sid]
    write_session_dump(dump_dir, LIVE_AREA, session.copied_record(), "snapshot")


def test_restore_is_snapshots_plus_replay_and_deletes_nothing(tmp_path):
    _snapshot(tmp_path, "session-a1", 2)
    segment = journal_dir(tmp_path) / "000000000001.wal"
    segment.parent.mkdir(parents=True)
    segment.write_bytes(
        segment_of(
            turn("session-a1", 1),  # already in the snapshot
            turn("session-a1", 2),
            jr.create_record("session-b1", KEY, 2.0, {}),
            turn("session-b1", 0),
        )
        + turn("session-b1", 1)[:-3]  # torn: never acknowledged
    )
    result = recover(tmp_path)
    assert result.sessions["session-a1"].num_turns == 3 and result.sessions["session-b1"].num_turns == 1
    assert not result.lost and not result.quarantined and result.last_seq == 1
    assert segment.exists() and (tmp_path / LIVE_AREA / "session-a1.safetensors").exists()


def test_restore_moves_altered_snapshots_to_corrupt_and_reports_their_sessions_lost(tmp_path):
    _snapshot(tmp_path, "session-a1", 1)
    _snapshot(tmp_path, "session-b1", 1)
    _snapshot(tmp_path, "session-c1", 1)
    live = tmp_path / LIVE_AREA
    data = bytearray((live / "session-a1.safetensors").read_bytes())
    data[-5] ^= 0x01  # a flipped bit in the tensor data: the checksum catches it
    (live / "session-a1.safetensors").write_bytes(bytes(data))
    (live / "session-b1.safetensors").rename(live / "session-x1.safetensors")  # header id != file name
    result = recover(tmp_path)
    assert set(result.sessions) == {"session-c1"}
    assert set(result.lost) == {"session-a1", "session-x1"}
    assert len(list((tmp_path / "corrupt").iterdir())) == 2 and sorted(p.name for p in live.iterdir()) == [
        "session-c1.safetensors"
    ]
    assert load_session_file(live / "session-c1.safetensors").session_id == "session-c1"


def test_a_session_lost_in_a_restart_answers_410_session_lost_to_the_admin_key(
    sglang_emulator_url, test_tokenizer_dir, tmp_path
):
    """The admin key learns why; the session's own key gets what any other key gets, 404 as for an
    unknown id: the proxy keeps no key digest for a lost session, so it cannot tell its key apart."""
    import httpx
    from proxy_harness import ADMIN, answer_but_the_id, bearer, running_proxy

    dumps = tmp_path / "dumps"
    with running_proxy(sglang_emulator_url, test_tokenizer_dir, dumps) as proxy:
        sid, key = proxy.create_session()
        kept, kept_key = proxy.create_session()
    snapshot = dumps / LIVE_AREA / f"{sid}.safetensors"
    data = bytearray(snapshot.read_bytes())
    data[-1] ^= 0x01  # altered on disk after the drain
    snapshot.write_bytes(bytes(data))
    with running_proxy(sglang_emulator_url, test_tokenizer_dir, dumps) as proxy:
        lost = httpx.get(f"{proxy.url}/v1/sessions/{sid}", headers=ADMIN)
        assert lost.status_code == 410 and lost.json()["error"]["code"] == "session_lost"
        assert "snapshot failed verification" in lost.json()["error"]["message"]
        to_own_key = httpx.get(f"{proxy.url}/v1/sessions/{sid}", headers=bearer(key))
        unknown = httpx.get(f"{proxy.url}/v1/sessions/never-existed", headers=bearer(key))
        assert to_own_key.status_code == 404
        assert answer_but_the_id(to_own_key, sid) == answer_but_the_id(unknown, "never-existed")
        assert httpx.get(f"{proxy.url}/v1/sessions/{kept}", headers=bearer(kept_key)).status_code == 200
        stats = proxy.stats()
        assert stats["sessions_lost"] == 1 and stats["totals"]["restore_failures"] == 1
    # Still known as lost after a further restart (lost-sessions.json), and the altered file is kept aside.
    with running_proxy(sglang_emulator_url, test_tokenizer_dir, dumps) as proxy:
        again = httpx.get(f"{proxy.url}/v1/sessions/{sid}", headers=ADMIN)
        assert again.status_code == 410 and again.json()["error"]["code"] == "session_lost"
    assert len(list((dumps / "corrupt").iterdir())) == 1


async def test_async_durability_acknowledges_at_once_and_syncs_within_the_window(tmp_path):
    journal = Journal(journal_dir(tmp_path), StorageHealth(), durability="async", flush_interval_s=0.05)
    await journal.open(0)
    assert journal.append(jr.create_record("session-a1", KEY, 1.0, {})) is None  # nothing to wait for
    await asyncio.sleep(0.3)
    ((_, path),) = list_segments(journal_dir(tmp_path))
    assert [r.session_id for r in jr.scan(path.read_bytes()).records] == ["session-a1"]
    await journal.close()


def test_a_session_whose_id_began_with_a_dash_before_the_rule_is_restored_and_reachable(
    sglang_emulator_url, test_tokenizer_dir, tmp_path
):
    import httpx
    from proxy_harness import ADMIN, running_proxy

    legacy = Session("-legacy-session-1", key_digest("legacy-key"))  # 1 in 64 generated ids did
    write_session_dump(tmp_path, LIVE_AREA, legacy.copied_record(), "drain")
    with running_proxy(sglang_emulator_url, test_tokenizer_dir, tmp_path) as proxy:
        got = httpx.get(
            f"{proxy.url}/v1/sessions/-legacy-session-1", headers={"Authorization": "Bearer legacy-key"}
        )
        assert got.status_code == 200 and got.json()["session_id"] == "-legacy-session-1"
        refused = httpx.post(f"{proxy.url}/v1/sessions", headers=ADMIN, json={"session_id": "-new-session-1"})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_session_id"


# Turn records as the proxy wrote them before the turn became one value (bytes fixed here): a tree
# turn with every field, and a linear turn written without the tree's keys.
TREE_TURN_RECORD = bytes.fromhex(
    "52464a3108020000ea3d705002e30100007b22736964223a2273657373696f6e2d6731222c22696e63223a2230303031"
    "303230333034303530363037222c227475726e223a312c226e5f696e223a322c226e5f6f7574223a332c226d65737361"
    "67655f636f756e74223a342c22646967657374223a223033303330333033303330333033303330333033303330333033"
    "3033303330333033303330333033303330333033303330333033303330333033303330333033222c2273746f70706564"
    "223a747275652c2273746f705f746f6b656e223a392c2276657273696f6e223a322c226368616e676573223a5b5b312c"
    "335d5d2c2274656d7065726174757265223a302e372c2274656d7065726564223a747275652c22706172656e74223a30"
    "2c226b656570223a352c2263616c6c223a312c2266696e697368223a312c22666c616773223a312c2263726561746564"
    "223a313730303030303030302e352c2273746f705f737472696e67223a6e756c6c2c226964656d706f74656e63795f6b"
    "6579223a226162616261626162616261626162616261626162616261626162616261626162222c227265717565737422"
    "3a2230343034303430343034303430343034303430343034303430343034303430343034303430343034303430343034"
    "303430343034303430343034303430343034227d0500000006000000070000000800000009000000000000bf000080be"
    "000000be"
)
LINEAR_TURN_RECORD = bytes.fromhex(
    "52464a311a0100002bd7216e02050100007b22736964223a2273657373696f6e2d6731222c22696e63223a2230303031"
    "303230333034303530363037222c227475726e223a302c226e5f696e223a322c226e5f6f7574223a312c226d65737361"
    "67655f636f756e74223a322c22646967657374223a223031303130313031303130313031303130313031303130313031"
    "3031303130313031303130313031303130313031303130313031303130313031303130313031222c2273746f70706564"
    "223a66616c73652c2273746f705f746f6b656e223a6e756c6c2c2276657273696f6e223a302c226368616e676573223a"
    "5b5d2c2274656d7065726174757265223a312e302c2274656d7065726564223a66616c73657d01000000020000000300"
    "0000000080bf"
)


def test_turn_records_of_todays_format_read_back_and_are_written_byte_for_byte():
    key = bytes(range(32))
    tree_turn = RecordedTurn(
        array("i", [5, 6]),
        array("i", [7, 8, 9]),
        array("f", [-0.5, -0.25, -0.125]),
        message_count=4,
        history_digest=bytes([3]) * 32,
        stopped=True,
        stop_token=9,
        model_version=2,
        version_changes=((1, 3),),
        temperature=0.7,
        tempered=True,
        parent=0,
        keep=5,
        call=1,
        request_digest=bytes([4]) * 32,
        finish=1,
        flags=1,
        created=1700000000.5,
        idempotency_key="ab" * 16,
    )
    (record,) = jr.scan(TREE_TURN_RECORD).records
    assert jr.recorded_turn(record) == tree_turn
    assert jr.turn_record("session-g1", key, 1, tree_turn) == TREE_TURN_RECORD
    (linear,) = jr.scan(LINEAR_TURN_RECORD).records
    assert jr.recorded_turn(linear) == RecordedTurn(
        array("i", [1, 2]),
        array("i", [3]),
        array("f", [-1.0]),
        message_count=2,
        history_digest=bytes([1]) * 32,
        stopped=False,
        stop_token=None,
        model_version=0,
        temperature=1.0,
    )
    session = Session("session-g1", key)
    session.append_turn(jr.recorded_turn(linear))
    assert (session.turn_parents.tolist(), session.turn_keeps.tolist(), session.turn_calls.tolist()) == (
        [-1],
        [0],
        [0],
    )
