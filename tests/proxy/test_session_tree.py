"""The session tree's pure parts: paths and samples of a hand-built tree, where a request is placed,
and dump files written before trees read back as linear sessions that can still be continued."""

from __future__ import annotations

from array import array
from pathlib import Path

import numpy as np
import orjson
from rolloutfleet_proxy.branching import attach, message_digests, place, request_digest, shared_prefix
from rolloutfleet_proxy.session import RecordedTurn, Session
from rolloutfleet_proxy.storage.dumps import FORMAT, LIVE_AREA, load_session_file, write_session_dump
from rolloutfleet_wire import session_tree as tree
from rolloutfleet_wire.session_record import EMPTY_DIGEST, ROOT
from safetensors.numpy import load_file, save_file

PARAMS = {"sampling": {"max_new_tokens": 8}}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def reply(text: str) -> dict:
    return {"role": "assistant", "content": text}


def add(session: Session, messages: list[dict], new_ids: list[int], output: list[int], **where) -> int:
    """Record a turn answering `messages` (placed by the caller) with `output` as the reply."""
    digests = message_digests(EMPTY_DIGEST, messages)
    end = message_digests(EMPTY_DIGEST, [*messages, reply(f"r{len(output)}-{output[0]}")])[-1]
    turn = RecordedTurn(
        array("i", new_ids),
        array("i", output),
        array("f", [-0.5] * len(output)),
        message_count=len(messages) + 1,
        history_digest=end,
        stopped=True,
        stop_token=output[-1],
        request_digest=request_digest(digests[-1], PARAMS),
        **where,
    )
    session.append_turn(turn)
    return session.num_turns - 1


def test_paths_leaves_and_samples_of_a_tree():
    s = Session("tree-1", b"k" * 32)
    history = [user("a")]
    t0 = add(s, history, [1, 2, 3], [10, 11])  # path 1 2 3 10 11
    history += [reply("r2-10"), user("b")]
    t1 = add(s, history, [4, 5], [12, 13])  # continues t0: 1 2 3 10 11 4 5 12 13
    # A sibling of t1: same prompt as t1 (kept inside t1's own segment), another output.
    t2 = add(s, history, [], [14], parent=t1, keep=7, call=2)
    # A compaction that kept the first two prompt tokens of t0.
    t3 = add(s, [user("summary")], [9], [15], parent=t0, keep=2)
    assert tree.path_ids(s, t1).tolist() == [1, 2, 3, 10, 11, 4, 5, 12, 13]
    assert tree.path_ids(s, t2).tolist() == [1, 2, 3, 10, 11, 4, 5, 14]
    assert tree.path_ids(s, t3).tolist() == [1, 2, 9, 15]
    assert tree.path_turns(s, t2) == [t0, t2]
    assert tree.path_turns(s, t3) == [t3]
    assert tree.leaves(s) == [t1, t2, t3]
    assert s.num_tokens == 12  # every shared token stored once
    sample = tree.path_record(s, t2, reward=1.0)
    assert sample.loss_mask.tolist() == [0, 0, 0, 1, 1, 0, 0, 1]
    assert sample.turn_bounds.tolist() == [0, 3, 5, 5, 7, 8]
    only_last = tree.path_record(s, t2, reward=None, only_turn_output=True)
    assert only_last.loss_mask.tolist() == [0, 0, 0, 0, 0, 0, 0, 1]
    assert only_last.logprobs.tolist()[3:5] == [0.0, 0.0]
    assert tree.shape_problem(s) is None
    latest = list(tree.samples(s, tree.SampleShape()))
    assert [place["turn"] for _, place in latest] == [t3]


def test_replaced_calls_are_left_out_on_request():
    s = Session("tree-2", b"k" * 32)
    t0 = add(s, [user("a")], [1], [10])
    add(s, [user("a")], [], [11], parent=t0, keep=1, call=1)  # the same request again: regenerated
    assert tree.replaced_calls(s) == {0}
    assert tree.sample_turns(s, tree.SAMPLES_LEAVES) == [0, 1]
    assert tree.sample_turns(s, tree.SAMPLES_LEAVES, drop_replaced=True) == [1]


def test_a_request_is_placed_after_the_deepest_recorded_reply_it_runs_through():
    s = Session("tree-3", b"k" * 32)
    t0 = add(s, [user("a")], [1, 2], [10])
    conversation = [user("a"), reply("r1-10"), user("b")]
    t1 = add(s, conversation, [3], [11])
    deeper = [*conversation, reply("r1-11"), user("c")]
    assert place(s, message_digests(EMPTY_DIGEST, deeper), PARAMS).base == t1
    assert place(s, message_digests(EMPTY_DIGEST, [user("a"), reply("r1-10"), user("x")]), PARAMS).base == t0
    assert place(s, message_digests(EMPTY_DIGEST, [user("other")]), PARAMS).base == ROOT
    # New ids that share a start with t1's prompt are attached inside it.
    assert attach(s, t0, array("i", [3, 7])) == (t1, 4)
    assert attach(s, t0, array("i", [8])) == (t0, 3)
    assert shared_prefix(array("i", [1, 2, 3]), array("i", [1, 2, 4, 5])) == 2


def test_a_dump_written_before_trees_reads_as_a_linear_session_that_continues(tmp_path: Path):
    s = Session("tree-old", b"k" * 32)
    add(s, [user("a")], [1, 2], [10])
    add(s, [user("a"), reply("r1-10"), user("b")], [3], [11, 12])
    path = write_session_dump(tmp_path, LIVE_AREA, s.to_record(), "test")
    tensors = load_file(str(path))
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = orjson.loads(orjson.loads(f.read(length))["__metadata__"][FORMAT])
    old_names = {"input_ids", "loss_mask", "logprobs", "turn_bounds", "turn_versions", "version_changes"}
    old = {name: np.ascontiguousarray(t) for name, t in tensors.items() if name in old_names}
    for key in ("turn_stop_strings", "idempotency_keys"):
        header.pop(key)
    header["format_version"] = 1  # before checksums, so the stripped file needs none
    header.pop("checksums")
    save_file(old, str(path), metadata={FORMAT: orjson.dumps(header).decode()})
    record = load_session_file(path)
    assert record.turn_parents.tolist() == [-1, 0]
    assert record.turn_keeps.tolist() == [0, 3]
    assert tree.digest_at(record.turn_end_digests, 1) == s.history_digest
    assert tree.path_ids(record, 1).tolist() == [1, 2, 10, 3, 11, 12]
    restored = Session.from_record(record)
    following = [user("a"), reply("r1-10"), user("b"), reply("r2-11"), user("c")]
    assert place(restored, message_digests(EMPTY_DIGEST, following), PARAMS).base == 1
