"""Routing replay's pure parts and formats: the row type of an expert count, SGLang's answer read
back, where each turn's rows are in a tree and which a path gathers, a turn's rows from aborted and
continued answers, and the journal, dump, routing file and export formats (older ones still read)."""

from __future__ import annotations

import base64
import zlib
from array import array
from pathlib import Path

import numpy as np
import pytest
from rolloutfleet_proxy.continuation import Segment
from rolloutfleet_proxy.routing_rows import next_start, turn_rows
from rolloutfleet_proxy.session import RecordedTurn, Session
from rolloutfleet_proxy.storage import journal_records as records
from rolloutfleet_proxy.storage.dumps import LIVE_AREA, load_session_file, write_session_dump
from rolloutfleet_proxy.storage.routing_store import (
    HEADER_BYTES,
    RoutingFiles,
    RoutingMemory,
    RoutingRestore,
    record_key,
)
from rolloutfleet_proxy.upstream import Generation
from rolloutfleet_wire import session_tree as tree
from rolloutfleet_wire.export_format import ExportRouting, decode_batch, encode_batch
from rolloutfleet_wire.routed_experts import (
    RoutingError,
    RoutingShape,
    first_row,
    path_rows,
    row_offsets,
    rows_from_sglang,
    shape_from_model_config,
)
from rolloutfleet_wire.routed_experts import (
    turn_rows as stored_rows,
)
from rolloutfleet_wire.session_record import NO_DIGEST, ROOT
from rolloutfleet_wire.session_tree import SAMPLES_LEAVES, SAMPLES_TURNS, SampleShape

SHAPE = RoutingShape(layers=3, top_k=2, experts=16)


def sglang_payload(rows: np.ndarray) -> str:
    """What SGLang's detokenizer sends: base64 of the int32 rows' bytes."""
    return base64.b64encode(rows.astype("<i4").tobytes()).decode()


def prefix_row(path: list[int], position: int, shape: RoutingShape = SHAPE) -> np.ndarray:
    """A stand-in for a model's routing of `position`: a function of the ids up to it (as a router's
    is of its prefix), so every branch sharing that prefix has the same row."""
    seed = zlib.crc32(np.array(path[: position + 1], np.int32).tobytes())
    rng = np.random.default_rng(seed)
    return np.stack([rng.choice(shape.experts, shape.top_k, replace=False) for _ in range(shape.layers)])


def rows_of(path: list[int], start: int, end: int, shape: RoutingShape = SHAPE) -> bytes:
    return (
        np.stack(
            [prefix_row(path, p, shape) for p in range(start, end)] or [np.zeros((shape.layers, shape.top_k))]
        )
        .astype(shape.dtype)[: end - start]
        .tobytes()
    )


def add(
    session: Session,
    new_ids: list[int],
    output: list[int],
    parent: int | None = None,
    keep: int | None = None,
) -> int:
    """Append a turn with its routing rows as the proxy stores them (from its first row on)."""
    parent = session.num_turns - 1 if parent is None else parent
    keep = tree.path_length(session, parent) if keep is None else keep
    path = tree.path_ids(session, parent).tolist()[:keep] + new_ids + output
    start = first_row(session, parent, keep)
    turn = RecordedTurn(
        array("i", new_ids),
        array("i", output),
        array("f", [-0.25] * len(output)),
        message_count=2,
        history_digest=NO_DIGEST,
        stopped=False,
        stop_token=None,
        parent=parent,
        keep=keep,
        routing=rows_of(path, start, len(path) - 1),
    )
    session.append_turn(turn)
    return session.num_turns - 1


def tree_session() -> Session:
    """A linear part, a branch inside a prompt (a compaction), a sibling sample and a continuation."""
    s = Session("session-r3-tree", b"\x05" * 32)
    add(s, [1, 2, 3], [10, 11], parent=ROOT, keep=0)  # t0: 1 2 3 10 11
    add(s, [4, 5], [12, 13])  # t1 continues t0
    add(s, [], [14, 15], parent=1, keep=7)  # t2: a sibling sample of t1 (its prompt, another output)
    add(s, [9], [16], parent=0, keep=2)  # t3: kept 1 2 of t0's prompt
    add(s, [6], [17, 18])  # t4 continues t3
    return s


def test_the_row_type_is_the_smallest_unsigned_one_that_holds_the_expert_count():
    assert RoutingShape(48, 8, 128).dtype == np.uint8 and RoutingShape(48, 8, 128).row_bytes == 384
    assert RoutingShape(61, 8, 256).dtype == np.uint8  # DeepSeek-V3: ids 0..255
    assert RoutingShape(2, 2, 257).dtype == np.uint16
    assert RoutingShape(2, 2, 65536).dtype == np.uint16
    assert RoutingShape(2, 2, 65537).dtype == np.uint32 and RoutingShape(2, 2, 65537).row_bytes == 16
    with pytest.raises(RoutingError):
        RoutingShape(2, 9, 8)  # more experts per token than there are


def test_the_shape_comes_from_config_json_as_sglang_reads_it():
    qwen3_moe = {"num_hidden_layers": 48, "num_experts_per_tok": 8, "num_experts": 128}
    assert shape_from_model_config(qwen3_moe) == RoutingShape(48, 8, 128)
    deepseek = {"num_hidden_layers": 61, "num_experts_per_tok": 8, "n_routed_experts": 256}
    assert shape_from_model_config(deepseek) == RoutingShape(61, 8, 256)
    gpt_oss = {"num_hidden_layers": 24, "num_experts_per_tok": 4, "num_local_experts": 32}
    assert shape_from_model_config(gpt_oss) == RoutingShape(24, 4, 32)
    assert shape_from_model_config({"text_config": qwen3_moe, "vision_config": {}}) == RoutingShape(
        48, 8, 128
    )
    with pytest.raises(RoutingError, match="num_experts_per_tok"):
        shape_from_model_config({"num_hidden_layers": 28, "hidden_size": 1024})  # a dense model


def test_sglang_rows_are_read_from_the_asked_start_and_checked():
    rows = np.arange(5 * 6).reshape(5, 3, 2) % 16
    assert rows_from_sglang(sglang_payload(rows[2:]), 2, 5, SHAPE) == rows[2:].astype(np.uint8).tobytes()
    # An engine that ignores routed_experts_start_len answers from position 0.
    assert rows_from_sglang(sglang_payload(rows), 2, 5, SHAPE) == rows[2:].astype(np.uint8).tobytes()
    with pytest.raises(RoutingError, match="rows"):
        rows_from_sglang(sglang_payload(rows[:4]), 2, 5, SHAPE)
    with pytest.raises(RoutingError, match="outside"):
        rows_from_sglang(sglang_payload(rows[2:] + 16), 2, 5, SHAPE)
    with pytest.raises(RoutingError, match="no meta_info"):
        rows_from_sglang(None, 0, 5, SHAPE)
    with pytest.raises(RoutingError, match="base64"):
        rows_from_sglang("not base64!", 0, 5, SHAPE)


def test_each_turn_stores_the_rows_its_path_lacks_and_a_path_gathers_them():
    s = tree_session()
    # t0 stores 0..3 (its last token 11 has no row yet); t1 stores the row of 11 and its own but 13.
    assert [first_row(s, s.turn_parents[t], s.turn_keeps[t]) for t in range(5)] == [0, 4, 7, 2, 3]
    assert [stored_rows(s, t) for t in range(5)] == [4, 4, 1, 1, 3]
    offsets = row_offsets(s)
    assert offsets == [0, 4, 8, 9, 10, 13]
    flat = b"".join(
        rows_of(
            tree.path_ids(s, t).tolist(),
            first_row(s, s.turn_parents[t], s.turn_keeps[t]),
            tree.path_length(s, t) - 1,
        )
        for t in range(5)
    )
    for turn in range(5):
        path = tree.path_ids(s, turn).tolist()
        gathered = b"".join(
            flat[a * SHAPE.row_bytes : b * SHAPE.row_bytes] for a, b in path_rows(s, turn, offsets)
        )
        assert gathered == rows_of(path, 0, len(path) - 1), turn


def test_a_path_through_a_turn_without_routing_has_none():
    s = tree_session()
    s.turn_routed[3] = 0
    assert path_rows(s, 4) is None and path_rows(s, 2) is not None


def answer(output: list[int], routed: np.ndarray | None, finish: str = "stop") -> Segment:
    generation = Generation(
        array("i", output),
        array("f", [-0.1] * len(output)),
        "",
        finish,
        None,
        0,
        routed_experts=None if routed is None else sglang_payload(routed),
    )
    return Segment(generation, 0)


def test_a_continued_turn_keeps_each_tokens_rows_from_the_answer_that_first_computed_them():
    prompt, start = 6, 5
    first = np.full((6 + 3 - 1 - start, 3, 2), 1)  # rows 5..7: old weights
    second = np.full((6 + 3 + 4 - 1 - 8, 3, 2), 2)  # asked from 8: the last old token, then the new ones
    segments = [answer([20, 21, 22], first, "abort")]
    assert next_start(start, prompt, segments) == 8
    segments.append(answer([23, 24, 25, 26], second))
    rows = np.frombuffer(turn_rows(start, prompt, segments, SHAPE), np.uint8).reshape(-1, 3, 2)
    assert [int(r[0, 0]) for r in rows] == [1, 1, 1, 2, 2, 2, 2]  # positions 5..11 (12, the last: none)


def test_an_abort_without_routing_leaves_its_positions_to_the_next_answer():
    segments = [answer([], None, "abort"), answer([20, 21], None, "abort")]
    assert next_start(5, 6, segments) == 5
    segments.append(answer([22], np.full((6 + 3 - 1 - 5, 3, 2), 3)))
    assert len(turn_rows(5, 6, segments, SHAPE)) == 3 * SHAPE.row_bytes
    with pytest.raises(RoutingError, match="--enable-return-routed-experts"):
        turn_rows(5, 6, [answer([20, 21], None)], SHAPE)


def test_journal_records_carry_a_turns_rows_and_older_records_still_read():
    turn = RecordedTurn(
        array("i", [1, 2]), array("i", [3]), array("f", [-0.5]), 2, NO_DIGEST, True, 3, routing=b"\x01" * 12
    )
    decoded = records.decode_payload(records.turn_record("s1", b"k" * 32, 0, turn)[records.FRAME_BYTES :])
    assert records.recorded_turn(decoded).routing == b"\x01" * 12
    plain = records.turn_record(
        "s1",
        b"k" * 32,
        0,
        RecordedTurn(array("i", [1]), array("i", [3]), array("f", [-0.5]), 2, NO_DIGEST, True, 3),
    )
    assert records.recorded_turn(records.decode_payload(plain[records.FRAME_BYTES :])).routing is None
    # One routing byte more than the header says: damage, refused.
    framed = records.turn_record("s1", b"k" * 32, 0, turn)
    with pytest.raises(records.RecordError):
        records.decode_payload(framed[records.FRAME_BYTES :] + b"\x00")


def test_the_session_keeps_a_crc_per_turn_not_the_rows(tmp_path: Path):
    s = tree_session()
    assert list(s.turn_routed) == [1] * 5
    path = write_session_dump(tmp_path, LIVE_AREA, s.to_record(), "drain")
    again = load_session_file(path)
    assert again.turn_routing_crcs == s.turn_routing_crcs and again.turn_routed == s.turn_routed


async def test_routing_files_hold_rows_at_their_offsets_and_a_failed_turn_is_cut_back(tmp_path: Path):
    store = RoutingFiles(tmp_path / "routing", lambda exc: exc, SHAPE)
    await store.append("a.k", b"\x01" * 12)
    await store.append("a.k", b"\x02" * 6)
    await store.truncate("a.k", 12)  # that turn could not be journaled
    await store.append("a.k", b"\x03" * 6)
    assert store.read("a.k") == b"\x01" * 12 + b"\x03" * 6
    assert (tmp_path / "routing" / "a.k.r3").stat().st_size == HEADER_BYTES + 18
    assert await store.collect({"b.k"}) == 1 and not (tmp_path / "routing" / "a.k.r3").exists()
    memory = RoutingMemory(SHAPE)
    await memory.append("a.k", b"\x01" * 6)
    assert memory.read("a.k") == b"\x01" * 6 and await memory.collect(set()) == 1


def test_a_restore_cuts_a_file_back_to_its_snapshot_and_refuses_damaged_rows(tmp_path: Path):
    s = tree_session()
    directory = tmp_path / "routing"
    flat = b"".join(
        rows_of(
            tree.path_ids(s, t).tolist(),
            first_row(s, s.turn_parents[t], s.turn_keeps[t]),
            tree.path_length(s, t) - 1,
        )
        for t in range(5)
    )
    directory.mkdir()
    path = directory / f"{record_key(s)}.r3"
    from rolloutfleet_proxy.storage.routing_store import header

    path.write_bytes(header(SHAPE) + flat + b"\x07" * 6)  # plus a turn that was never journaled
    restore = RoutingRestore(directory, SHAPE)
    assert restore.from_snapshot(s) is None
    assert restore.finish({s.session_id: s}) == {}
    assert path.read_bytes() == header(SHAPE) + flat
    damaged = bytearray(path.read_bytes())
    damaged[-1] ^= 1
    path.write_bytes(bytes(damaged))
    assert "checksum" in (RoutingRestore(directory, SHAPE).from_snapshot(s) or "")


def test_exports_carry_each_samples_rows_aligned_with_its_tokens_and_older_batches_read():
    s = tree_session()
    s.finished = True
    flat = b"".join(
        rows_of(
            tree.path_ids(s, t).tolist(),
            first_row(s, s.turn_parents[t], s.turn_keeps[t]),
            tree.path_length(s, t) - 1,
        )
        for t in range(5)
    )
    routing = ExportRouting(lambda record: flat, SHAPE)
    for mode in (SAMPLES_LEAVES, SAMPLES_TURNS):
        batch = decode_batch(encode_batch("b1", [s.to_record()], 0, SampleShape(mode), routing=routing))
        assert batch.routing == SHAPE
        assert batch.tensors["routed_experts"].dtype == np.uint8
        for i in range(batch.num_trajectories):
            ids = batch.trajectory(i)["input_ids"]
            expected = np.frombuffer(rows_of(ids, 0, len(ids) - 1), np.uint8).reshape(-1, 3, 2)
            assert np.array_equal(batch.routed_experts(i), expected)
            assert batch.routed_experts(i).nbytes == (len(ids) - 1) * SHAPE.row_bytes
    plain = decode_batch(encode_batch("b2", [s.to_record()], 0))
    assert plain.routing is None and plain.trajectory(0)["routed_experts_rows"] == 0
