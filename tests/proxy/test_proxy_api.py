"""The proxy over real sockets: real uvicorn servers on 127.0.0.1, the CPU reference engine upstream
(a test stand-in for SGLang), the official openai client, real dump files."""

from __future__ import annotations

import asyncio
import math
import time

import httpx
import pytest
from openai import OpenAI
from proxy_harness import ADMIN, ADMIN_KEY, answer_but_the_id, bearer, chat_body, running_proxy
from rolloutfleet_proxy.storage.dumps import STALE_AREA, load_session_file
from rolloutfleet_testkit.processes import (
    ServerProcess,
    free_port,
    python_module,
    serve_app,
    wait_until_routed,
)
from rolloutfleet_testkit.sglang_emulator.model import load_model, score
from rolloutfleet_testkit.sglang_emulator.server import create_app as create_engine_app
from rolloutfleet_testkit.upstream_stub import create_app as create_stub_app
from transformers import AutoTokenizer


@pytest.fixture(scope="module")
def engine_url(test_tokenizer_dir):
    with serve_app(create_engine_app(str(test_tokenizer_dir), seed=0)) as url:
        yield url


@pytest.fixture(scope="module")
def slow_upstream_url():
    """A fixed-latency upstream (test stand-in) slow enough to act during a turn."""
    with serve_app(create_stub_app(latency_s=1.0, output_tokens=5)) as url:
        yield url


@pytest.fixture(scope="module")
def hf_tokenizer(test_tokenizer_dir):
    return AutoTokenizer.from_pretrained(str(test_tokenizer_dir))


@pytest.fixture(scope="module")
def model(test_tokenizer_dir):
    return load_model(str(test_tokenizer_dir), seed=0)


@pytest.fixture
def proxy(engine_url, test_tokenizer_dir, tmp_path):
    with running_proxy(engine_url, test_tokenizer_dir, tmp_path / "dumps") as p:
        yield p


def assert_matches_engine(model, trajectory: dict) -> None:
    """Every recorded output token's logprob is what the engine's model computes for it in context."""
    ids, mask, logprobs = trajectory["input_ids"], trajectory["loss_mask"], trajectory["logprobs"]
    assert len(ids) == len(mask) == len(logprobs)
    for start, out_start, end in trajectory["turns"]:
        assert all(m == 0 for m in mask[start:out_start]) and all(m == 1 for m in mask[out_start:end])
        expected = score(model, ids[:out_start], ids[out_start:end])
        assert expected == pytest.approx(logprobs[out_start:end], abs=1e-4)


def test_openai_client_multi_turn_is_token_exact(proxy, model, hf_tokenizer):
    sid, key = proxy.create_session(metadata={"task": "t-1"})
    client = OpenAI(base_url=f"{proxy.url}/v1/sessions/{sid}", api_key=key, max_retries=0)
    messages = [{"role": "system", "content": "Be brief."}]
    for i, question in enumerate(["Hello there!", "Tell me more.", "Why?"]):
        messages.append({"role": "user", "content": question})
        reply = client.chat.completions.create(
            model="m", messages=messages, max_tokens=12, seed=i, logprobs=True
        )
        choice = reply.choices[0]
        assert reply.usage.completion_tokens == len(choice.logprobs.content) > 0
        messages.append(choice.message.model_dump())  # as rollout code does: None fields included
    data = proxy.get(sid, key).json()
    assert data["num_turns"] == 3 and data["metadata"] == {"task": "t-1"}
    trajectory = data["trajectory"]
    assert_matches_engine(model, trajectory)
    # The stored ids extend turn by turn; the first turn is exactly the chat template's rendering.
    first_prompt = hf_tokenizer.apply_chat_template(messages[:2], add_generation_prompt=True, tokenize=False)
    _, out_start, _ = trajectory["turns"][0]
    assert trajectory["input_ids"][:out_start] == hf_tokenizer.encode(first_prompt, add_special_tokens=False)
    assert sum(trajectory["loss_mask"]) == sum(end - out for _, out, end in trajectory["turns"])


def test_continuation_renders_like_the_full_template(proxy, hf_tokenizer):
    """Appended ids decode to exactly what the chat template renders for the whole conversation, while
    the model's own output ids are kept as generated (re-tokenizing its text would give other ids)."""
    sid, key = proxy.create_session()
    messages = []
    auth = {"Authorization": f"Bearer {key}"}
    for question in ["One?", "Two?", "Three?"]:
        messages.append({"role": "user", "content": question})
        answer = httpx.post(
            f"{proxy.url}/v1/sessions/{sid}/chat/completions",
            headers=auth,
            json=chat_body(messages, max_tokens=200, temperature=0),
        ).json()
        assert answer["choices"][0]["finish_reason"] == "stop"  # the engine's EOS bonus ends replies
        messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
    trajectory = proxy.get(sid, key).json()["trajectory"]
    ids = trajectory["input_ids"]
    rendered = hf_tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=False)
    _, last_out, last_end = trajectory["turns"][-1]
    assert hf_tokenizer.decode(ids[:last_out], skip_special_tokens=False) == rendered
    assert ids[last_end - 1] == hf_tokenizer.eos_token_id
    # Each non-generated segment is exactly the tokenization of its own text.
    for start, out_start, _ in trajectory["turns"]:
        segment_text = hf_tokenizer.decode(ids[start:out_start], skip_special_tokens=False)
        assert ids[start:out_start] == hf_tokenizer.encode(segment_text, add_special_tokens=False)


def test_stream_returns_sse_of_the_recorded_reply(proxy):
    sid, key = proxy.create_session()
    client = OpenAI(base_url=f"{proxy.url}/v1/sessions/{sid}", api_key=key, max_retries=0)
    stream = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Stream please"}],
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage, finish = "", None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert finish in ("stop", "length") and usage.completion_tokens > 0
    data = proxy.get(sid, key).json()
    assert data["num_turns"] == 1 and sum(data["trajectory"]["loss_mask"]) == usage.completion_tokens
    # The streamed text is the recorded reply: sending it back as history is accepted.
    follow = client.chat.completions.create(
        model="m",
        max_tokens=4,
        messages=[
            {"role": "user", "content": "Stream please"},
            {"role": "assistant", "content": text},
            {"role": "user", "content": "again"},
        ],
    )
    assert follow.choices[0].message.content is not None


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
EARLIER_TOOL_ROUND = [
    {"role": "user", "content": "weather in Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "snow"}'},
]


@pytest.mark.router
@pytest.mark.parametrize("with_tools", [False, True], ids=["plain", "tools"])
def test_through_the_real_sglang_router(
    engine_url, test_tokenizer_dir, model, hf_tokenizer, tmp_path, with_tools
):
    port, metrics_port = free_port(), free_port()
    router_url = f"http://127.0.0.1:{port}"
    args = python_module(
        "sglang_router.launch_router",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        engine_url,
        "--policy",
        "round_robin",
        "--log-level",
        "warn",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics_port),
    )
    with ServerProcess(args, tmp_path / "router.log") as router:
        router.wait_ready(f"{router_url}/health", 60)
        wait_until_routed(router_url)
        parser = {"tool_call_parser": "qwen25"} if with_tools else {}
        with running_proxy(router_url, test_tokenizer_dir, tmp_path / "dumps", **parser) as proxy:
            sid, key = proxy.create_session()
            client = OpenAI(base_url=f"{proxy.url}/v1/sessions/{sid}", api_key=key, max_retries=0)
            messages = [
                *(EARLIER_TOOL_ROUND if with_tools else ()),
                {"role": "user", "content": "via the router"},
            ]
            tools = {"tools": [WEATHER_TOOL]} if with_tools else {}
            for turn in range(2):
                reply = client.chat.completions.create(
                    model="m", messages=messages, max_tokens=8, seed=turn, **tools
                )
                messages += [reply.choices[0].message.model_dump(), {"role": "user", "content": "more"}]
            data = proxy.get(sid, key).json()
            assert data["num_turns"] == 2
            assert_matches_engine(model, data["trajectory"])
            if with_tools:  # the tools and the earlier tool round were rendered into the first prompt
                first_prompt = data["trajectory"]["input_ids"][: data["trajectory"]["turns"][0][1]]
                assert (
                    first_prompt
                    == hf_tokenizer.apply_chat_template(
                        [
                            *EARLIER_TOOL_ROUND[:1],
                            {
                                **EARLIER_TOOL_ROUND[1],
                                "tool_calls": [
                                    {
                                        **EARLIER_TOOL_ROUND[1]["tool_calls"][0],
                                        "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
                                    }
                                ],
                            },
                            EARLIER_TOOL_ROUND[2],
                            {"role": "user", "content": "via the router"},
                        ],
                        tools=[WEATHER_TOOL],
                        add_generation_prompt=True,
                        tokenize=True,
                    )["input_ids"]
                )
                assert "<tools>" in hf_tokenizer.decode(first_prompt)


# --- concurrency -------------------------------------------------------------------------------


async def test_concurrent_turns_on_one_session_one_wins(slow_upstream_url, test_tokenizer_dir, tmp_path):
    with running_proxy(slow_upstream_url, test_tokenizer_dir, tmp_path / "d") as proxy:
        sid, key = proxy.create_session()
        url = f"{proxy.url}/v1/sessions/{sid}/chat/completions"
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=30) as client:
            body = chat_body([{"role": "user", "content": "race"}])
            results = await asyncio.gather(*(client.post(url, json=body) for _ in range(5)))
        codes = sorted(r.status_code for r in results)
        assert codes == [200, 409, 409, 409, 409]
        assert {r.json()["error"]["code"] for r in results if r.status_code == 409} == {"session_busy"}
        data = proxy.get(sid, key).json()
        assert data["num_turns"] == 1 and data["num_tokens"] == len(data["trajectory"]["input_ids"])
        assert proxy.stats()["totals"]["turns_busy_rejected"] == 4


async def test_delete_during_turn_cancels_it(slow_upstream_url, test_tokenizer_dir, tmp_path):
    with running_proxy(slow_upstream_url, test_tokenizer_dir, tmp_path / "d") as proxy:
        sid, key = proxy.create_session()
        auth = {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(base_url=proxy.url, headers=auth, timeout=30) as client:
            turn = asyncio.create_task(
                client.post(
                    f"/v1/sessions/{sid}/chat/completions", json=chat_body([{"role": "user", "content": "x"}])
                )
            )
            await asyncio.sleep(0.3)
            started = time.monotonic()
            deleted = await client.delete(f"/v1/sessions/{sid}")
            turn_response = await turn
            assert time.monotonic() - started < 0.6  # cancelled, not waited out
            later = await client.get(f"/v1/sessions/{sid}")
        assert deleted.status_code == 204
        assert turn_response.status_code == 410 and turn_response.json()["error"]["code"] == "session_deleted"
        assert later.status_code == 404
        stats = proxy.stats()
        assert stats["live_sessions"] == 0 and stats["tokens_held"] == 0 and stats["inflight_turns"] == 0


async def test_cleanup_during_turn_never_splits_it(slow_upstream_url, test_tokenizer_dir, tmp_path):
    """Stale timeout shorter than the turn: the busy session is not dumped mid-turn; once idle it is,
    with the turn in it, and the client then learns it ended (410) rather than being served empty.

    The turn is sent right after the session is created, by a client opened before: a session idle
    past the timeout before its turn arrives is rightly being dumped (409 session_busy), so the gap
    must stay far below the timeout even on a loaded machine (opening a client can take 0.3 s)."""
    dumps = tmp_path / "d"
    with running_proxy(
        slow_upstream_url, test_tokenizer_dir, dumps, stale_session_timeout_s=0.5, cleanup_interval_s=0.1
    ) as proxy:
        async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as client:
            created = (await client.post("/v1/sessions", headers=ADMIN, json={})).json()
            sid, auth = created["session_id"], {"Authorization": f"Bearer {created['session_key']}"}
            response = await client.post(
                f"/v1/sessions/{sid}/chat/completions",
                headers=auth,
                json=chat_body([{"role": "user", "content": "long turn"}]),
            )
            assert response.status_code == 200
            for _ in range(50):
                if proxy.stats()["totals"]["sessions_dumped"]:
                    break
                await asyncio.sleep(0.1)
            later = await client.get(f"/v1/sessions/{sid}", headers=auth)
        assert later.status_code == 410 and "dumped" in later.json()["error"]["message"]
        (path,) = (dumps / STALE_AREA).iterdir()
        record = load_session_file(path)
        assert record.session_id == sid and len(record.turn_bounds) == 3
        assert list(record.loss_mask).count(1) == 5  # the stub's 5 output tokens, recorded once


# --- activity and the stale timeout -----------------------------------------------------------


def test_a_polling_reader_does_not_keep_an_idle_session(engine_url, test_tokenizer_dir, tmp_path):
    """A dashboard reads a session (summary, trajectory, listing) every 0.1 s: the session is still
    written to disk once idle past the stale timeout, and the reader then learns that it ended."""
    with running_proxy(
        engine_url, test_tokenizer_dir, tmp_path / "d", stale_session_timeout_s=0.5, cleanup_interval_s=0.1
    ) as proxy:
        sid, key = proxy.create_session()
        deadline = time.monotonic() + 10  # twenty timeouts: ample on a loaded machine
        tokens = False
        while True:
            answer = proxy.get(sid, key, tokens=tokens)
            assert httpx.get(f"{proxy.url}/v1/sessions", headers=ADMIN).status_code == 200
            if answer.status_code == 410 or time.monotonic() > deadline:
                break
            assert answer.status_code in (200, 409), answer.text  # 409: being written right now
            tokens = not tokens
            time.sleep(0.1)
        assert answer.status_code == 410 and answer.json()["error"]["code"] == "session_gone", answer.text
        assert proxy.stats()["totals"]["sessions_dumped"] == 1


def test_changes_count_as_activity_and_reads_do_not(proxy):
    """Idle time as cleanup measures it: reads leave it running; a turn, a reward and finishing start
    it again; finishing a finished session changes nothing, so it does not either."""
    sid, key = proxy.create_session()
    auth = {"Authorization": f"Bearer {key}"}
    url = f"{proxy.url}/v1/sessions/{sid}"
    session = proxy.runtime.store.get(sid)

    def restarts_idle_time(call) -> bool:
        time.sleep(0.5)  # idle at least this long before the call
        idle_before = session.idle_seconds(time.monotonic())
        answer = call()
        assert answer.is_success, answer.text
        return session.idle_seconds(time.monotonic()) < idle_before

    reads = [
        lambda: proxy.get(sid, key),
        lambda: proxy.get(sid, key, tokens=False),
        lambda: httpx.get(url, headers=ADMIN),
        lambda: httpx.get(f"{proxy.url}/v1/sessions", headers=ADMIN),
    ]
    assert [restarts_idle_time(read) for read in reads] == [False] * len(reads)
    turn = chat_body([{"role": "user", "content": "hi"}])
    assert restarts_idle_time(lambda: httpx.post(f"{url}/chat/completions", headers=auth, json=turn))
    assert restarts_idle_time(lambda: httpx.post(f"{url}/reward", headers=auth, json={"reward": 1}))
    assert restarts_idle_time(lambda: httpx.post(f"{url}/finish", headers=auth))
    assert not restarts_idle_time(lambda: httpx.post(f"{url}/finish", headers=auth))
    assert not restarts_idle_time(reads[0])


# --- keys ----------------------------------------------------------------------------------------


def test_an_ended_session_tells_its_own_key_and_the_admin_key_and_no_other(
    engine_url, test_tokenizer_dir, tmp_path
):
    """Once dumped after idling, a session answers 410 `session_gone` to its key and to the admin
    key; any other key, another session's real key included, gets what an id never created gets."""
    with running_proxy(
        engine_url, test_tokenizer_dir, tmp_path / "d", stale_session_timeout_s=0.3, cleanup_interval_s=0.1
    ) as proxy:
        sid, key = proxy.create_session()
        _, other_key = proxy.create_session()
        deadline = time.monotonic() + 10
        while proxy.stats()["totals"]["sessions_dumped"] < 2:
            assert time.monotonic() < deadline, proxy.stats()["totals"]
            time.sleep(0.1)
        url = f"{proxy.url}/v1/sessions/{sid}"
        for told in (httpx.get(url, headers=bearer(key)), httpx.get(url, headers=ADMIN)):
            error = told.json()["error"]
            assert told.status_code == 410 and error["code"] == "session_gone" and "idle" in error["message"]
        unknown = "never-created-1"
        for stranger in ("rfs-made-up", other_key):
            to_ended = httpx.get(url, headers=bearer(stranger))
            to_unknown = httpx.get(f"{proxy.url}/v1/sessions/{unknown}", headers=bearer(stranger))
            assert to_ended.status_code == 404 and to_ended.json()["error"]["code"] == "not_found"
            assert answer_but_the_id(to_ended, sid) == answer_but_the_id(to_unknown, unknown)


# --- failures and bad input --------------------------------------------------------------------


def test_upstream_failures_leave_session_untouched(test_tokenizer_dir, tmp_path, proxy):
    sid, key = proxy.create_session()
    auth = {"Authorization": f"Bearer {key}"}
    first = httpx.post(
        f"{proxy.url}/v1/sessions/{sid}/chat/completions",
        headers=auth,
        json=chat_body([{"role": "user", "content": "ok"}]),
    )
    assert first.status_code == 200
    before = proxy.get(sid, key).json()
    messages = [
        {"role": "user", "content": "ok"},
        first.json()["choices"][0]["message"],
        {"role": "user", "content": "again"},
    ]
    # Same session store, but pointed at a dead upstream and at one slower than the timeout.
    dead_port = free_port()
    for upstream, timeout, expected in ((f"http://127.0.0.1:{dead_port}", 5.0, 502), (None, 0.3, 504)):
        with serve_app(create_stub_app(latency_s=2.0, output_tokens=3)) as slow:
            from rolloutfleet_proxy.upstream import SGLangClient

            original = proxy.runtime.turns._upstream
            proxy.runtime.turns._upstream = SGLangClient(upstream or slow, timeout, 4)
            try:
                failed = httpx.post(
                    f"{proxy.url}/v1/sessions/{sid}/chat/completions",
                    headers=auth,
                    json=chat_body(messages),
                    timeout=30,
                )
            finally:
                proxy.runtime.turns._upstream = original
        assert failed.status_code == expected, failed.text
        assert failed.json()["error"]["code"] in ("upstream_error", "upstream_timeout")
        assert proxy.get(sid, key).json() == before
    retried = httpx.post(
        f"{proxy.url}/v1/sessions/{sid}/chat/completions", headers=auth, json=chat_body(messages)
    )
    assert retried.status_code == 200 and proxy.get(sid, key).json()["num_turns"] == 2


def test_bad_input_gets_clear_4xx_and_leaves_state_intact(proxy):
    sid, key = proxy.create_session()
    other_sid, other_key = proxy.create_session()
    auth = {"Authorization": f"Bearer {key}"}
    chat = f"{proxy.url}/v1/sessions/{sid}/chat/completions"
    good = chat_body([{"role": "user", "content": "hi"}])
    first = httpx.post(chat, headers=auth, json=good)
    assert first.status_code == 200
    answered = [{"role": "user", "content": "hi"}, first.json()["choices"][0]["message"]]
    before = proxy.get(sid, key).json()
    huge = b'{"messages": [{"role": "user", "content": "' + b"x" * (9 * 1024 * 1024) + b'"}]}'

    def chunks():
        yield huge[: 1024 * 1024]
        yield huge[1024 * 1024 :]

    nested_metadata: dict = {}
    for _ in range(299):  # 300 levels: deeper than orjson serializes
        nested_metadata = {"k": nested_metadata}

    cases = [
        (
            "malformed json",
            lambda: httpx.post(
                chat, headers={**auth, "content-type": "application/json"}, content=b'{"messages": ['
            ),
        ),
        ("not an object", lambda: httpx.post(chat, headers=auth, json=[1, 2])),
        ("bad role", lambda: httpx.post(chat, headers=auth, json=chat_body([{"role": "x", "content": "a"}]))),
        ("oversized body", lambda: httpx.post(chat, headers=auth, content=huge)),
        ("oversized chunked body", lambda: httpx.post(chat, headers=auth, content=chunks())),
        (
            "path-like id",
            lambda: httpx.post(
                f"{proxy.url}/v1/sessions/..%2F..%2Fetc/chat/completions", headers=auth, json=good
            ),
        ),
        ("dotted id", lambda: httpx.get(f"{proxy.url}/v1/sessions/abc..defgh", headers=auth)),
        ("overlong id", lambda: httpx.get(f"{proxy.url}/v1/sessions/{'a' * 65}", headers=auth)),
        ("missing key", lambda: httpx.post(chat, json=good)),
        ("wrong key", lambda: httpx.post(chat, headers={"Authorization": "Bearer nope"}, json=good)),
        (
            "another session's key",
            lambda: httpx.post(chat, headers={"Authorization": f"Bearer {other_key}"}, json=good),
        ),
        ("unknown session", lambda: httpx.get(f"{proxy.url}/v1/sessions/unknown-session-1", headers=ADMIN)),
        ("session key on admin route", lambda: httpx.post(f"{proxy.url}/v1/sessions", headers=auth)),
        ("too many samples", lambda: httpx.post(chat, headers=auth, json={**good, "n": 10_000})),
        (
            "regenerate not a boolean",
            lambda: httpx.post(chat, headers=auth, json={**good, "regenerate": "yes"}),
        ),
        (
            "empty idempotency key",
            lambda: httpx.post(chat, headers={**auth, "Idempotency-Key": ""}, json=good),
        ),
        (
            "idempotency key of another request",
            lambda: httpx.post(chat, headers={**auth, "Idempotency-Key": "k1"}, json=chat_body([])),
        ),
        ("no new messages", lambda: httpx.post(chat, headers=auth, json=chat_body(answered))),
        (
            "client-chosen id taken",
            lambda: httpx.post(f"{proxy.url}/v1/sessions", headers=ADMIN, json={"session_id": other_sid}),
        ),
        (
            "bad reward",
            lambda: httpx.post(
                f"{proxy.url}/v1/sessions/{sid}/reward", headers=auth, json={"reward": "high"}
            ),
        ),
        (
            "reward turn out of range",
            lambda: httpx.post(
                f"{proxy.url}/v1/sessions/{sid}/reward", headers=auth, json={"reward": 1, "turn": 7}
            ),
        ),
        ("bad query parameter", lambda: httpx.get(f"{proxy.url}/v1/sessions?limit=lots", headers=ADMIN)),
        (
            "metadata list",
            lambda: httpx.post(f"{proxy.url}/v1/sessions", headers=ADMIN, json={"metadata": []}),
        ),
        (
            "tools",
            lambda: httpx.post(
                chat,
                headers=auth,
                json=chat_body([{"role": "user", "content": "a"}], tools=[{"type": "function"}]),
            ),
        ),
        (
            "bad metadata",
            lambda: httpx.post(f"{proxy.url}/v1/sessions", headers=ADMIN, json={"metadata": "x"}),
        ),
        (
            "metadata nested too deep",
            lambda: httpx.post(f"{proxy.url}/v1/sessions", headers=ADMIN, json={"metadata": nested_metadata}),
        ),
    ]
    expected = {
        "malformed json": 400,
        "not an object": 400,
        "bad role": 400,
        "oversized body": 413,
        "oversized chunked body": 413,
        "path-like id": 404,
        "dotted id": 400,
        "overlong id": 400,
        "missing key": 401,
        "wrong key": 404,  # as for an unknown id: a key learns nothing of sessions it does not open
        "another session's key": 404,
        "unknown session": 404,
        "session key on admin route": 401,
        "too many samples": 400,
        "regenerate not a boolean": 400,
        "empty idempotency key": 400,
        "idempotency key of another request": 400,
        "no new messages": 400,
        "client-chosen id taken": 409,
        "bad reward": 400,
        "reward turn out of range": 400,
        "bad metadata": 400,
        "bad query parameter": 400,
        "metadata list": 400,
        "metadata nested too deep": 400,
        "tools": 400,
    }
    for name, call in cases:
        response = call()
        assert response.status_code == expected[name], (name, response.text[:300])
        error = response.json()["error"]
        assert error["code"] and error["message"], name
    assert proxy.get(sid, key).json() == before
    stats = proxy.stats()
    assert stats["live_sessions"] == 2 and stats["totals"]["turns"] == 1


def test_reward_finish_and_metrics(proxy):
    sid, key = proxy.create_session()
    auth = {"Authorization": f"Bearer {key}"}
    chat = f"{proxy.url}/v1/sessions/{sid}/chat/completions"
    assert (
        httpx.post(chat, headers=auth, json=chat_body([{"role": "user", "content": "a"}])).status_code == 200
    )
    assert httpx.post(
        f"{proxy.url}/v1/sessions/{sid}/reward", headers=auth, json={"reward": 0.5, "turn": 0}
    ).is_success
    assert httpx.post(f"{proxy.url}/v1/sessions/{sid}/reward", headers=auth, json={"reward": 1}).is_success
    finished = httpx.post(f"{proxy.url}/v1/sessions/{sid}/finish", headers=auth).json()
    assert finished["finished"] and finished["reward"] == 1.0 and finished["turn_rewards"] == {"0": 0.5}
    after = httpx.post(chat, headers=auth, json=chat_body([{"role": "user", "content": "b"}]))
    assert after.status_code == 409 and after.json()["error"]["code"] == "session_finished"
    stats = proxy.stats()
    for field in (
        "pid",
        "rss_bytes",
        "vms_bytes",
        "live_sessions",
        "tokens_held",
        "inflight_turns",
        "last_cleanup_seconds",
        "trim_available",
    ):
        assert field in stats
    assert stats["rss_bytes"] > 10_000_000 and stats["tokens_held"] > 0
    assert stats["totals"]["sessions_created"] == 1 and stats["totals"]["sessions_finished"] == 1
    metrics = httpx.get(f"{proxy.url}/metrics").text
    assert f"rolloutfleet_proxy_tokens_held {float(stats['tokens_held'])}" in metrics
    assert "rolloutfleet_proxy_turns_total 1.0" in metrics
    listing = httpx.get(f"{proxy.url}/v1/sessions", headers=ADMIN).json()
    assert listing["total"] == 1 and listing["sessions"][0]["session_id"] == sid
    assert httpx.get(f"{proxy.url}/healthz").status_code == 200
    assert httpx.get(f"{proxy.url}/readyz").status_code == 200


def test_logprob_values_are_finite(proxy):
    sid, key = proxy.create_session()
    client = OpenAI(base_url=f"{proxy.url}/v1/sessions/{sid}", api_key=key, max_retries=0)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "z"}], max_tokens=6)
    logprobs = proxy.get(sid, key).json()["trajectory"]["logprobs"]
    assert all(math.isfinite(x) and x <= 0 for x in logprobs)


def test_settings_route_reports_what_the_proxy_runs_with_and_never_the_admin_key(proxy, engine_url):
    response = httpx.get(f"{proxy.url}/v1/settings", headers=ADMIN)
    assert response.status_code == 200
    settings = response.json()
    assert settings["upstream_url"] == engine_url and settings["dump_dir"] == str(proxy.dump_dir)
    assert settings["stale_session_timeout_s"] == proxy.runtime.settings.stale_session_timeout_s
    assert "admin_key" not in settings and ADMIN_KEY not in response.text
    _, session_key = proxy.create_session()
    for headers in ({}, {"Authorization": f"Bearer {session_key}"}):
        refused = httpx.get(f"{proxy.url}/v1/settings", headers=headers)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthorized"


def test_new_sessions_are_refused_near_the_memory_budget_while_turns_go_on(
    engine_url, test_tokenizer_dir, tmp_path
):
    with running_proxy(engine_url, test_tokenizer_dir, tmp_path / "dumps") as proxy:
        sid, key = proxy.create_session()
        # A soft limit just below what the process holds now: it is "near its budget".
        proxy.runtime.settings.rss_soft_limit_bytes = proxy.stats()["rss_bytes"] // 2
        refused = httpx.post(f"{proxy.url}/v1/sessions", headers=ADMIN, json={})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
        assert refused.json()["error"]["code"] == "memory_pressure"
        turn = httpx.post(
            f"{proxy.url}/v1/sessions/{sid}/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json=chat_body([{"role": "user", "content": "hi"}]),
            timeout=60,
        )
        assert turn.status_code == 200, turn.text
        stats = proxy.stats()
        assert stats["totals"]["sessions_refused_memory"] == 1 and stats["live_sessions"] == 1
        proxy.runtime.settings.rss_soft_limit_bytes = 0
        assert httpx.post(f"{proxy.url}/v1/sessions", headers=ADMIN, json={}).status_code == 201
