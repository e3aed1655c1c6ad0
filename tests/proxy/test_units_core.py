"""Unit tests of the proxy's pure parts: history, sessions, store, settings, heap, upstream parsing."""

from __future__ import annotations

import time
from array import array

import orjson
import pytest
from pydantic import ValidationError
from rolloutfleet_proxy.errors import ProxyError, http_error
from rolloutfleet_proxy.failures import (
    Failure,
    SessionBeingWritten,
    SessionEnded,
    SessionExists,
    SessionLostInRestart,
    UnknownSession,
    UpstreamFailed,
)
from rolloutfleet_proxy.heap import HeapTrimmer, resolve_malloc_trim
from rolloutfleet_proxy.history import EMPTY_DIGEST, InvalidMessage, canonical_message, extend_digest
from rolloutfleet_proxy.ids import is_valid_session_id, key_digest, key_matches, new_session_id
from rolloutfleet_proxy.openai_format import parse_chat_request
from rolloutfleet_proxy.session import RecordedTurn, Session
from rolloutfleet_proxy.settings import ENV, ProxySettings, env_var_name, load_settings
from rolloutfleet_proxy.store import SessionStore
from rolloutfleet_proxy.upstream import parse_generate_answer

BASE = {"upstream_url": "http://127.0.0.1:1", "tokenizer_path": "/nonexistent", "admin_key": "k"}


# --- history -------------------------------------------------------------------------------------


def test_canonical_message_drops_null_fields_and_joins_text_parts():
    from_openai_client = {"role": "assistant", "content": "hi", "refusal": None, "tool_calls": None}
    assert canonical_message(from_openai_client) == {"role": "assistant", "content": "hi"}
    parts = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert canonical_message(parts) == {"role": "user", "content": "ab"}


@pytest.mark.parametrize(
    "message",
    [
        {"role": "wizard", "content": "x"},
        {"content": "x"},
        "text",
        {"role": "user", "content": 5},
        {"role": "user", "content": [{"type": "image_url", "image_url": {}}]},  # no url
        {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x"}}]},
        {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
    ],
)
def test_canonical_message_rejects_invalid(message):
    with pytest.raises(InvalidMessage):
        canonical_message(message)


def test_digest_is_order_and_content_sensitive():
    a, b = {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}
    assert extend_digest(EMPTY_DIGEST, [a, b]) == extend_digest(extend_digest(EMPTY_DIGEST, [a]), [b])
    assert extend_digest(EMPTY_DIGEST, [a, b]) != extend_digest(EMPTY_DIGEST, [b, a])
    assert extend_digest(EMPTY_DIGEST, [a]) != extend_digest(
        EMPTY_DIGEST, [{"role": "user", "content": "a "}]
    )


# --- ids -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("sid", ["../../etc", "a/b/c/d/e", "short", "x" * 65, "abc.defgh", "with space1", ""])
def test_invalid_session_ids(sid):
    assert not is_valid_session_id(sid)


def test_generated_ids_and_keys():
    ids = {new_session_id() for _ in range(100)}
    assert len(ids) == 100 and all(is_valid_session_id(i) for i in ids)
    assert key_matches("secret", key_digest("secret")) and not key_matches("secreT", key_digest("secret"))


# --- session -------------------------------------------------------------------------------------


def record_turn(session: Session, n_in: int, n_out: int, first_id: int = 1) -> int:
    return session.append_turn(
        RecordedTurn(
            array("i", range(first_id, first_id + n_in)),
            array("i", [7] * n_out),
            array("f", [-0.5] * n_out),
            message_count=session.message_count + 2,
            history_digest=b"\x01" * 32,
            stopped=False,
            stop_token=None,
        ),
    )


async def test_session_arrays_are_typed_and_aligned():
    session = Session("session-1", key_digest("k"))
    assert record_turn(session, 3, 2) == 5
    assert record_turn(session, 1, 4, first_id=100) == 5
    assert (session.token_ids.typecode, session.loss_mask.typecode, session.logprobs.typecode) == (
        "i",
        "B",
        "f",
    )
    assert session.token_ids.tolist() == [1, 2, 3, 7, 7, 100, 7, 7, 7, 7]
    assert session.loss_mask.tolist() == [0, 0, 0, 1, 1, 0, 1, 1, 1, 1]
    assert session.logprobs.tolist() == [0, 0, 0, -0.5, -0.5, 0, -0.5, -0.5, -0.5, -0.5]
    assert session.turns() == [(0, 3, 5), (5, 6, 10)]
    with pytest.raises(ValueError):
        session.append_turn(
            RecordedTurn(
                array("i"),
                array("i", [1]),
                array("f"),
                message_count=1,
                history_digest=b"",
                stopped=False,
                stop_token=None,
            ),
        )
    assert session.num_tokens == 10  # a refused record changes nothing


async def test_session_record_round_trip():
    session = Session("session-2", key_digest("k"), {"task": "t1"})
    record_turn(session, 4, 3)
    session.set_reward(1.5, None)
    session.set_reward(0.25, 0)
    restored = Session.from_record(session.to_record())
    assert restored.summary() == session.summary()
    assert restored.trajectory() == session.trajectory()


# --- store ---------------------------------------------------------------------------------------


async def test_store_detach_skips_busy_and_reports_states():
    store = SessionStore(tombstone_capacity=2)
    idle, busy = Session("idle-0001", b"k"), Session("busy-0001", b"k")
    for s in (idle, busy):
        store.add(s)
        s.last_active = time.monotonic() - 100
    record_turn(idle, 2, 2)
    await busy.lock.acquire()
    stale = store.detach_stale(time.monotonic(), timeout_s=10)
    assert stale == [idle] and len(store) == 1
    with pytest.raises(SessionBeingWritten) as busy_error:
        store.get("idle-0001")
    answer = http_error(busy_error.value)
    assert (answer.status, answer.code, answer.headers) == (409, "session_busy", {"Retry-After": "1"})
    store.reattach(idle)
    assert store.get("idle-0001") is idle
    store.detach_stale(time.monotonic(), timeout_s=10)
    store.forget(idle, "dumped")
    with pytest.raises(SessionEnded) as gone:
        store.get("idle-0001")
    assert http_error(gone.value).status == 410 and "dumped" in gone.value.message
    with pytest.raises(UnknownSession) as unknown:
        store.get("never-existed")
    assert http_error(unknown.value).status == 404
    with pytest.raises(SessionExists) as exists:
        store.add(Session("busy-0001", b"k"))
    assert http_error(exists.value).status == 409


async def test_store_tokens_held_and_bounded_tombstones():
    store = SessionStore(tombstone_capacity=2)
    sessions = [Session(f"session-{i:03d}", b"k") for i in range(4)]
    for s in sessions:
        store.add(s)
        store.record_growth(record_turn(s, 2, 3))
    assert store.tokens_held == 20
    store.remove("session-000", "deleted")
    with pytest.raises(UnknownSession) as deleted:
        store.get("session-000")
    assert http_error(deleted.value).status == 404  # deleted sessions are simply unknown afterwards
    detached = store.detach_all()
    for s in detached:
        store.forget(s, "dumped")
    assert store.tokens_held == 0
    statuses = []
    for sid in ("session-001", "session-002", "session-003"):
        with pytest.raises(Failure) as ended:
            store.get(sid)
        statuses.append(http_error(ended.value).status)
    assert statuses == [404, 410, 410]  # dumped sessions are remembered, up to the bound


def test_store_tells_a_key_only_about_the_session_it_opens():
    """`get_with_key`: the session's own key gets what the admin key gets (`get`); any other key gets
    UnknownSession for every id, whatever the store holds, and so does every key for a lost session
    (no key digest survives with it)."""
    store = SessionStore(tombstone_capacity=4)
    own, other = key_digest("rfs-own"), key_digest("rfs-other")
    live, written, ended = (Session(sid, own) for sid in ("live-0001", "written-01", "ended-0001"))
    for session in (live, written, ended):
        store.add(session)
    store.detach_all()
    store.reattach(live)
    store.forget(ended, "dumped")
    store.mark_lost("lost-00001", "its snapshot failed verification")
    assert store.get_with_key("live-0001", own) is live
    with pytest.raises(SessionBeingWritten):
        store.get_with_key("written-01", own)
    with pytest.raises(SessionEnded):
        store.get_with_key("ended-0001", own)
    for sid in ("live-0001", "written-01", "ended-0001", "lost-00001", "never-0001"):
        with pytest.raises(UnknownSession) as unknown:
            store.get_with_key(sid, other)
        assert unknown.value.message == f"unknown session {sid}, or not one this key opens"
    with pytest.raises(UnknownSession):
        store.get_with_key("lost-00001", own)
    with pytest.raises(SessionLostInRestart):
        store.get("lost-00001")  # the admin key's lookup


# --- settings ------------------------------------------------------------------------------------


def test_env_names_are_the_contract(monkeypatch):
    assert env_var_name("stale_session_timeout_s") == "ROLLOUTFLEET_PROXY_STALE_SESSION_TIMEOUT_S"
    assert set(ENV) == set(ProxySettings.model_fields)
    with pytest.raises(KeyError):
        env_var_name("no_such_setting")
    for name, value in {**BASE, "dump_dir": "/tmp/d", "stale_session_timeout_s": "12.5"}.items():
        monkeypatch.setenv(ENV[name], value)
    settings = load_settings()
    assert settings.stale_session_timeout_s == 12.5 and str(settings.dump_dir) == "/tmp/d"


def test_cli_flags_override_environment(monkeypatch):
    for name, value in {**BASE, "dump_dir": "/tmp/d", "port": "9000"}.items():
        monkeypatch.setenv(ENV[name], value)
    settings = load_settings(["--port", "9100", "--cleanup-interval-s", "2", "--no-trim-heap"])
    assert (settings.port, settings.cleanup_interval_s, settings.trim_heap) == (9100, 2.0, False)


def test_refuses_to_start_without_dump_dir_unless_dropping_is_chosen():
    with pytest.raises(ValidationError, match="no dump directory"):
        ProxySettings(**BASE)
    assert ProxySettings(**BASE, allow_dropping_sessions=True).dump_dir is None


# --- heap ----------------------------------------------------------------------------------------


def test_heap_trimmer_handles_missing_and_failing_symbol():
    assert HeapTrimmer(enabled=False).available is False

    def failing(_pad: int) -> int:
        raise OSError("no")

    trimmer = HeapTrimmer(trim_fn=failing)
    assert trimmer.available and trimmer.trim() is False and not trimmer.available
    real = resolve_malloc_trim()  # glibc on this machine; None on musl
    if real is not None:
        assert HeapTrimmer().trim() is True


# --- upstream answers ----------------------------------------------------------------------------


def sglang_answer(ids, logprobs, finish=None, **extra):
    return orjson.dumps(
        {
            "text": "x",
            "output_ids": ids,
            "meta_info": {
                "finish_reason": finish or {"type": "length", "length": len(ids)},
                "prompt_tokens": 3,
                "output_token_logprobs": [[lp, i, None] for lp, i in zip(logprobs, ids, strict=True)],
            },
            **extra,
        }
    )


def test_parse_generate_answer_keeps_exact_ids_and_logprobs():
    gen = parse_generate_answer(sglang_answer([5, 6, 9], [-0.1, -0.2, -0.3], {"type": "stop", "matched": 9}))
    assert gen.output_ids.tolist() == [5, 6, 9] and gen.output_ids.typecode == "i"
    assert [round(x, 5) for x in gen.logprobs.tolist()] == [-0.1, -0.2, -0.3]
    assert gen.stop_token == 9 and gen.finish_reason == "stop"
    assert parse_generate_answer(sglang_answer([5, 6], [-0.1, -0.2])).stop_token is None


def test_parse_generate_answer_keeps_the_tokens_of_an_aborted_generation():
    # SGLang answers an abort (pause in abort mode, weight update) with HTTP 200 and the partial tokens.
    gen = parse_generate_answer(sglang_answer([5], [-0.1], {"type": "abort", "message": "weights updating"}))
    assert gen.aborted and gen.abort_message == "weights updating"
    assert gen.output_ids.tolist() == [5] and gen.stop_token is None
    # Aborted while still queued: no tokens and (in some releases) no output_token_logprobs at all.
    empty = parse_generate_answer(
        orjson.dumps({"text": "", "output_ids": [], "meta_info": {"finish_reason": {"type": "abort"}}})
    )
    assert empty.aborted and len(empty.output_ids) == 0 and empty.abort_message == "no reason given"


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"{}",
        orjson.dumps({"meta_info": {}}),
        orjson.dumps({"output_ids": [1, 2], "meta_info": {"output_token_logprobs": [[-0.1, 1, None]]}}),
        orjson.dumps({"meta_info": {"output_token_logprobs": [["x"]]}}),
    ],
)
def test_parse_generate_answer_rejects_inconsistent(body):
    with pytest.raises(UpstreamFailed) as error:
        parse_generate_answer(body)
    assert http_error(error.value).status == 502


# --- chat requests -------------------------------------------------------------------------------


def test_parse_chat_request_maps_sampling_and_rejects_bad_values():
    req = parse_chat_request(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 7,
            "temperature": 0.5,
            "stop": "x",
            "seed": 3,
            "unknown_param": 1,
        },
        100,
    )
    assert req.sampling_params == {"max_new_tokens": 7, "temperature": 0.5, "stop": ["x"], "sampling_seed": 3}
    for bad in (
        {"messages": []},
        {"messages": [{"role": "user", "content": "a"}], "n": 2},
        {"messages": [{"role": "user", "content": "a"}], "temperature": "hot"},
        {"messages": [{"role": "user", "content": "a"}], "max_tokens": 0},
        [],
    ):
        with pytest.raises(ProxyError) as error:
            parse_chat_request(bad, 100)
        assert error.value.status == 400


def test_loop_lag_monitor_windows_the_maximum():
    from rolloutfleet_proxy.looplag import LoopLagMonitor

    monitor = LoopLagMonitor(window_s=3)
    monitor.record(0.5, now=100.2)
    monitor.record(0.01, now=101.0)
    monitor.record(0.02, now=101.5)
    assert monitor.recent_max(101.9) == 0.5 and monitor.max_s == 0.5
    assert monitor.recent_max(103.5) == 0.02  # the 0.5 s stall has left the 3 s window
    assert monitor.recent_max(110.0) == 0.0 and monitor.max_s == 0.5


async def test_loop_lag_monitor_sees_a_blocking_call():
    import asyncio

    from rolloutfleet_proxy.looplag import LoopLagMonitor

    monitor = LoopLagMonitor(interval_s=0.005)
    task = asyncio.create_task(monitor.run())
    await asyncio.sleep(0.02)
    time.sleep(0.1)  # noqa: ASYNC251 (blocks the loop on purpose)
    await asyncio.sleep(0.02)
    task.cancel()
    assert 0.08 < monitor.max_s < 1.0
