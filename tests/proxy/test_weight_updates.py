"""Weight updates and aborted generations: SGLang answers an aborted request (a pause in abort mode,
a weight update) with HTTP 200, `finish_reason {"type": "abort"}` and the tokens made so far
(`Scheduler.abort_request`, `TokenizerManager._handle_batch_output`); the proxy keeps them and
continues the same turn, recording each token under the `meta_info.weight_version` it came with.

The pure pieces (`continuation.py`) are tested directly; the proxy-level tests use a small ASGI
upstream that answers exactly like that (a scripted stand-in: it aborts when told to)."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from array import array

import httpx
import orjson
import pytest
from proxy_harness import ADMIN, running_proxy
from rolloutfleet_proxy.continuation import (
    Segment,
    continuation_request,
    engine_version,
    logprobs_tempered,
    merge_segments,
)
from rolloutfleet_proxy.session import RecordedTurn, Session
from rolloutfleet_proxy.upstream import Generation
from rolloutfleet_testkit.asgi import lifespan, read_body, send_json
from rolloutfleet_testkit.processes import serve_app
from rolloutfleet_testkit.routed_engines import routed_emulators
from rolloutfleet_wire.session_record import token_versions


def generation(ids, finish="length", version="7", stop=None, text=None) -> Generation:
    return Generation(
        output_ids=array("i", ids),
        logprobs=array("f", [-0.1 * (i + 1) for i in range(len(ids))]),
        text=text if text is not None else "".join(f"<{i}>" for i in ids),
        finish_reason=finish,
        stop_token=stop,
        prompt_tokens=5,
        weight_version=version,
        abort_message="paused" if finish == "abort" else None,
    )


def decode(ids: list[int]) -> str:
    return "".join(f"<{i}>" for i in ids)


# --- pure functions ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("weight_version", "expected"),
    [("12", 12), (" 3 ", 3), ("default", 99), (None, 99), ("-1", 99), (str(2**31), 99)],
)
def test_engine_version_is_the_engines_integer_weight_version_else_the_proxys(weight_version, expected):
    assert engine_version(weight_version, 99) == expected


@pytest.mark.parametrize(
    ("setting", "sampling", "expected"),
    [
        ("tempered", {}, (1.0, False)),  # SGLang's default temperature 1: tempered == raw
        ("tempered", {"temperature": 0.7}, (0.7, True)),
        ("tempered", {"temperature": 0.0}, (0.0, False)),  # greedy: raw log_softmax
        ("tempered", {"temperature": 0.7, "top_k": 1}, (0.7, False)),  # top_k 1 is greedy too
        ("original", {"temperature": 0.7}, (0.7, False)),  # SGLANG_RETURN_ORIGINAL_LOGPROB=1
    ],
)
def test_which_turns_have_tempered_logprobs(setting, sampling, expected):
    temperature, tempered = logprobs_tempered(setting, sampling)
    assert (round(temperature, 6), tempered) == expected


def test_continuation_request_resends_prompt_and_partial_with_the_rest_of_the_budget():
    segments = [Segment(generation([10, 11, 12], "abort"), 3)]
    prompt, sampling = continuation_request(
        array("i", [1, 2]), {"max_new_tokens": 8, "min_new_tokens": 5}, segments
    )
    assert prompt.tolist() == [1, 2, 10, 11, 12]
    assert sampling == {"max_new_tokens": 5, "min_new_tokens": 2}
    spent = [Segment(generation(list(range(8)), "abort"), 3)]
    assert continuation_request(array("i", [1]), {"max_new_tokens": 8}, spent) is None


def test_merge_keeps_every_token_and_where_the_version_changed():
    segments = [
        Segment(generation([10, 11], "abort", "3"), 3),
        Segment(generation([], "abort", "3"), 3),  # aborted again before a token
        Segment(generation([12, 13, 2], "stop", "4", stop=2), 4),
    ]
    turn = merge_segments(segments, 16, decode)
    assert turn.generation.output_ids.tolist() == [10, 11, 12, 13, 2]
    assert len(turn.generation.logprobs) == 5
    assert turn.generation.finish_reason == "stop" and turn.generation.stop_token == 2
    assert turn.generation.text == decode([10, 11, 12, 13, 2])
    assert (turn.version, turn.version_changes, turn.continuations) == (3, [(2, 4)], 2)


def test_merge_of_a_turn_aborted_as_its_budget_ran_out_is_a_length_finish():
    turn = merge_segments([Segment(generation([10, 11], "abort"), 1)] * 2, 4, decode)
    assert turn.generation.finish_reason == "length"


def test_per_token_versions_follow_the_changes_inside_their_turn():
    session = Session("s", b"k")
    session.append_turn(RecordedTurn(
        array("i", [1, 2]), array("i", [10, 11, 12]), array("f", [-1, -1, -1]),
        message_count=2, history_digest=b"d" * 32, stopped=False, stop_token=None,
        model_version=3, version_changes=[(2, 4)], temperature=0.7, tempered=True,
    ))  # fmt: skip
    session.append_turn(RecordedTurn(
        array("i", [5]), array("i", [20, 21]), array("f", [-1, -1]),
        message_count=4, history_digest=b"e" * 32, stopped=False, stop_token=None, model_version=4,
    ))  # fmt: skip
    assert token_versions(session.to_record()).tolist() == [-1, -1, 3, 3, 4, -1, 4, 4]
    assert session.turn_tempered.tolist() == [1, 0] and math.isnan(session.turn_temperatures[1])
    with pytest.raises(ValueError, match="inside the output"):
        session.append_turn(RecordedTurn(
            array("i", []), array("i", [1]), array("f", [-1]),
            message_count=6, history_digest=b"f" * 32, stopped=False, stop_token=None,
            version_changes=[(1, 5)],
        ))  # fmt: skip


# --- the proxy against an upstream that aborts ---------------------------------------------------


class AbortingUpstream:
    """Answers /generate as SGLang does: `abort_next` requests are aborted after `partial` tokens
    (HTTP 200, finish abort, the partial tokens); others finish with `length`. Token i of a request is
    100 + its position in the whole turn, so a continuation's tokens follow on from the partial ones.
    `release` holds answers while cleared (a generation in flight). After an abort the weights are
    `updated_version`, as after a weight update in abort mode."""

    def __init__(self, partial: int = 3, updated_version: str = "3"):
        self.partial = partial
        self.abort_next = 0
        self.weight_version = "3"
        self.updated_version = updated_version
        self.requests: list[dict] = []
        self.release = threading.Event()
        self.release.set()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        body = orjson.loads(await read_body(receive))
        self.requests.append(body)
        await asyncio.to_thread(self.release.wait)
        budget = body["sampling_params"]["max_new_tokens"]
        start = len(body["input_ids"]) - len(self.requests[0]["input_ids"])  # tokens of this turn so far
        if self.abort_next:
            self.abort_next -= 1
            count, finish = min(self.partial, budget), {"type": "abort", "message": "Abort by pause."}
        else:
            count, finish = budget, {"type": "length", "length": budget}
        ids = [100 + start + i for i in range(count)]
        meta = {
            "id": body.get("rid"),
            "finish_reason": finish,
            "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": count,
            "cached_tokens": 0,
            "weight_version": self.weight_version,
            "output_token_logprobs": [[-0.5, i, None] for i in ids],
        }
        if finish["type"] == "abort":
            self.weight_version = self.updated_version
        answer = {"text": "", "output_ids": ids, "meta_info": meta}
        samples = body["sampling_params"].get("n", 1)
        # A group (n > 1) is answered as SGLang does, a list of its samples; a pause aborts them all.
        await send_json(send, 200, [answer] * samples if samples > 1 else answer)


def _turn(proxy, sid, key, max_tokens=8) -> httpx.Response:
    return httpx.post(
        f"{proxy.url}/v1/sessions/{sid}/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"messages": [{"role": "user", "content": "go"}], "max_tokens": max_tokens, "temperature": 0.7},
        timeout=30,
    )


def test_an_aborted_generation_is_continued_into_one_turn_with_its_versions(test_tokenizer_dir):
    upstream = AbortingUpstream(partial=3, updated_version="4")
    upstream.abort_next = 1
    with serve_app(upstream) as url, running_proxy(url, test_tokenizer_dir, None) as proxy:
        sid, key = proxy.create_session()
        response = _turn(proxy, sid, key, max_tokens=8)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 8
        assert len(upstream.requests) == 2
        resent = upstream.requests[1]
        assert resent["input_ids"] == upstream.requests[0]["input_ids"] + [100, 101, 102]
        assert resent["sampling_params"]["max_new_tokens"] == 5
        assert resent["rid"] != upstream.requests[0]["rid"]
        trajectory = proxy.get(sid, key).json()["trajectory"]
        _, output_start, end = trajectory["turns"][0]
        assert trajectory["input_ids"][output_start:end] == list(range(100, 108))
        assert trajectory["versions"][output_start:end] == [3, 3, 3, 4, 4, 4, 4, 4]
        assert trajectory["turn_versions"] == [3]
        assert trajectory["turn_temperatures"] == [pytest.approx(0.7)] and trajectory["turn_tempered"] == [
            True
        ]
        totals = proxy.stats()["totals"]
        assert totals["turns_continued"] == 1 and totals["generated_tokens_continued"] == 3
        assert totals["generated_tokens_discarded"] == 0


def test_every_aborted_sample_of_a_group_is_continued_on_its_own(test_tokenizer_dir):
    upstream = AbortingUpstream(partial=3, updated_version="4")
    upstream.abort_next = 1  # the group's one request: both samples come back aborted
    with serve_app(upstream) as url, running_proxy(url, test_tokenizer_dir, None) as proxy:
        sid, key = proxy.create_session()
        response = httpx.post(
            f"{proxy.url}/v1/sessions/{sid}/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"messages": [{"role": "user", "content": "go"}], "max_tokens": 8, "n": 2},
            timeout=30,
        )
        assert response.status_code == 200, response.text
        assert len(response.json()["choices"]) == 2
        assert response.json()["usage"]["completion_tokens"] == 16
        group, *continuations = upstream.requests
        assert group["sampling_params"]["n"] == 2 and len(continuations) == 2
        for resent in continuations:
            assert "n" not in resent["sampling_params"]
            assert resent["input_ids"] == group["input_ids"] + [100, 101, 102]
            assert resent["sampling_params"]["max_new_tokens"] == 5
        session = proxy.get(sid, key).json()
        assert session["num_turns"] == 2 and session["num_branches"] == 2
        versions = session["trajectory"]["versions"]
        assert versions[-8:] == [3, 3, 3, 4, 4, 4, 4, 4]
        totals = proxy.stats()["totals"]
        assert totals["turns_continued"] == 2 and totals["generated_tokens_continued"] == 6
        assert totals["generated_tokens_discarded"] == 0


def test_a_continuation_waits_for_the_proxys_resume(test_tokenizer_dir):
    upstream = AbortingUpstream(partial=2)
    upstream.abort_next = 1
    upstream.release.clear()
    with serve_app(upstream) as url, running_proxy(url, test_tokenizer_dir, None) as proxy:
        sid, key = proxy.create_session()
        result: list[httpx.Response] = []
        worker = threading.Thread(target=lambda: result.append(_turn(proxy, sid, key, max_tokens=4)))
        worker.start()
        deadline = time.monotonic() + 10
        while not upstream.requests and time.monotonic() < deadline:
            time.sleep(0.01)
        assert httpx.post(f"{proxy.url}/v1/generation/pause", headers=ADMIN).status_code == 200
        upstream.release.set()  # the engine aborts the generation: 2 tokens
        time.sleep(0.3)
        assert len(upstream.requests) == 1, "the continuation went out while the proxy was paused"
        assert httpx.get(f"{proxy.url}/v1/generation", headers=ADMIN).json()["paused_turns"] == 1
        httpx.post(f"{proxy.url}/v1/generation/resume", headers=ADMIN)
        worker.join(10)
        assert result and result[0].status_code == 200, result
        assert len(upstream.requests) == 2
        trajectory = proxy.get(sid, key).json()["trajectory"]
        _, output_start, end = trajectory["turns"][0]
        assert trajectory["input_ids"][output_start:end] == [100, 101, 102, 103]


def test_an_engine_that_aborts_every_time_gets_a_retryable_503_after_the_ride_through_bound(
    test_tokenizer_dir,
):
    upstream = AbortingUpstream(partial=0)
    upstream.abort_next = 10**6
    with (
        serve_app(upstream) as url,
        running_proxy(url, test_tokenizer_dir, None, abort_ride_through_s=1.0) as proxy,
    ):
        sid, key = proxy.create_session()
        before = proxy.get(sid, key).json()
        started = time.monotonic()
        response = _turn(proxy, sid, key)
        elapsed = time.monotonic() - started
        assert response.status_code == 503 and response.json()["error"]["code"] == "upstream_aborted"
        assert 1.0 <= elapsed < 5, elapsed  # the bound, plus at most one backoff and one answer
        # Backed off while nothing was generated: a handful of resubmissions, not a storm.
        assert 3 <= len(upstream.requests) <= 25, len(upstream.requests)
        assert proxy.get(sid, key).json() == before


def test_a_trainer_driven_abort_storm_is_ridden_through_with_every_token_kept_once(test_tokenizer_dir):
    """The trainer aborts the engine itself (not through the proxy) for 3 s, as slime, verl and AReaL
    do around a weight update: every answer in that time is an abort. The first kept 3 tokens; the
    turn goes on once the engine generates again, with nothing lost or duplicated."""
    upstream = AbortingUpstream(partial=3, updated_version="4")
    upstream.abort_next = 1
    storm_until = time.monotonic() + 3.0
    generate = upstream.__call__

    async def stormy(scope, receive, send):
        if scope["type"] == "http" and upstream.requests and time.monotonic() < storm_until:
            upstream.partial, upstream.abort_next = 0, 1  # aborted again at once, nothing made
        else:
            upstream.partial = 3
        await generate(scope, receive, send)

    with (
        serve_app(stormy) as url,
        running_proxy(url, test_tokenizer_dir, None, abort_ride_through_s=30) as proxy,
    ):
        sid, key = proxy.create_session()
        response = _turn(proxy, sid, key, max_tokens=8)
        assert response.status_code == 200, response.text
        resumed_at = time.monotonic()
        assert resumed_at - storm_until < 1.5  # noticed the engine generating again within the backoff cap
        trajectory = proxy.get(sid, key).json()["trajectory"]
        _, output_start, end = trajectory["turns"][0]
        assert trajectory["input_ids"][output_start:end] == list(range(100, 108))  # each token once
        assert trajectory["versions"][output_start:end] == [3, 3, 3, 4, 4, 4, 4, 4]
        totals = proxy.stats()["totals"]
        assert totals["generated_tokens_discarded"] == 0 and totals["generated_tokens_continued"] == 3
        assert 3 <= len(upstream.requests) <= 40


# --- what dumps and exports keep -------------------------------------------------------------------


def _session_spanning_an_update() -> Session:
    session = Session("s-update", b"k" * 32)
    session.append_turn(RecordedTurn(
        array("i", [1, 2]), array("i", [10, 11, 12]), array("f", [-0.1, -0.2, -0.3]),
        message_count=2, history_digest=b"d" * 32, stopped=False, stop_token=None,
        model_version=3, version_changes=[(1, 4)], temperature=0.7, tempered=True,
    ))  # fmt: skip
    return session


def test_a_dump_keeps_versions_inside_turns_and_temperatures(tmp_path):
    from rolloutfleet_proxy.storage.dumps import LIVE_AREA, load_session_file, write_session_dump

    record = _session_spanning_an_update().to_record()
    path = write_session_dump(tmp_path, LIVE_AREA, record, "drain")
    loaded = load_session_file(path)
    assert token_versions(loaded).tolist() == [-1, -1, 3, 4, 4]
    assert loaded.turn_temperatures.tolist() == [pytest.approx(0.7)] and loaded.turn_tempered.tolist() == [1]


def test_an_export_carries_per_token_versions_and_how_logprobs_were_made():
    from rolloutfleet_wire.export_format import batch_json, decode_batch, encode_batch

    record = _session_spanning_an_update().to_record()
    batch = decode_batch(encode_batch("batch-1", [record], 4))
    trajectory = batch.trajectory(0)
    assert trajectory["versions"] == [-1, -1, 3, 4, 4]
    assert trajectory["turn_temperatures"] == [pytest.approx(0.7)] and trajectory["turn_tempered"] == [True]
    assert (
        orjson.loads(batch_json(encode_batch("batch-1", [record], 4)))["trajectories"][0]["versions"][-1] == 4
    )


def test_a_version_1_batch_still_decodes():
    import numpy as np
    from rolloutfleet_wire.export_format import FORMAT, decode_batch, encode_batch
    from safetensors.numpy import load, save

    data = encode_batch("batch-1", [_session_spanning_an_update().to_record()], 4)
    tensors = load(data)
    del tensors["turn_temperatures"], tensors["turn_tempered"]
    header_len = int.from_bytes(data[:8], "little")
    header = orjson.loads(orjson.loads(data[8 : 8 + header_len])["__metadata__"][FORMAT])
    header["format_version"] = 1
    old = decode_batch(save(tensors, metadata={FORMAT: orjson.dumps(header).decode()}))
    assert np.isnan(old.tensors["turn_temperatures"]).all() and old.trajectory(0)["turn_tempered"] == [False]


# --- the real sglang-router over two SGLang emulators, a weight update in the middle of a rollout -----


def _play(proxy, sessions: list[tuple[str, str]], turns: int, errors: list) -> None:
    def one(sid: str, key: str) -> None:
        messages: list[dict] = []
        for turn in range(turns):
            messages.append({"role": "user", "content": f"turn {turn} of {sid}: tell me more"})
            response = httpx.post(
                f"{proxy.url}/v1/sessions/{sid}/chat/completions",
                headers={"Authorization": f"Bearer {key}"},
                json={"messages": messages, "max_tokens": 40, "temperature": 0.8},
                timeout=120,
            )
            if response.status_code != 200:
                errors.append(response.text)
                return
            messages.append(response.json()["choices"][0]["message"])

    threads = [threading.Thread(target=one, args=s) for s in sessions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)


@pytest.mark.router
@pytest.mark.parametrize("mode", ["abort", "in_place"])
def test_a_weight_update_mid_rollout_loses_no_token_and_records_versions(mode, test_tokenizer_dir, tmp_path):
    from rolloutfleet_client.trainer import TrainerClient
    from rolloutfleet_testkit.sglang_emulator.model import load_model, score
    from rolloutfleet_testkit.sglang_emulator.server import write_weights
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(test_tokenizer_dir))
    models = {
        v: load_model(len(tokenizer), seed=s, eos_token_id=tokenizer.eos_token_id)
        for v, s in ((0, 0), (1, 7))
    }
    weights = write_weights(tmp_path / "v1", seed=7)
    with (
        # 20 ms per decode step: generations are in flight when the trainer pauses the engines.
        routed_emulators(test_tokenizer_dir, tmp_path, token_delay_s=0.02) as (router_url, engines),
        running_proxy(router_url, test_tokenizer_dir, None) as proxy,
    ):
        sessions = [proxy.create_session() for _ in range(6)]
        errors: list = []
        rollout = threading.Thread(target=_play, args=(proxy, sessions, 3, errors))
        rollout.start()
        deadline = time.monotonic() + 30
        while proxy.stats()["inflight_turns"] < 4:  # generations under way on both engines
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.3)
        with TrainerClient(proxy.url, ADMIN["Authorization"].split()[1], engine_urls=engines) as trainer:
            steps = trainer.update_weights(1, model_path=str(weights), mode=mode)
        assert set(steps["weights"]) == set(engines)
        rollout.join(300)
        assert not errors, errors
        totals = proxy.stats()["totals"]
        assert totals["turns"] == 18 and totals["generated_tokens_discarded"] == 0
        if mode == "abort":
            assert totals["turns_continued"] >= 1 and totals["generated_tokens_continued"] > 0
        else:
            assert totals["turns_continued"] == 0
        spanning = 0
        for sid, key in sessions:
            trajectory = proxy.get(sid, key).json()["trajectory"]
            assert len(trajectory["turns"]) == 3  # every turn recorded once
            for _, output_start, end in trajectory["turns"]:
                versions = trajectory["versions"][output_start:end]
                ended_on_eos = trajectory["input_ids"][end - 1] == tokenizer.eos_token_id
                assert end - output_start == 40 or ended_on_eos, "a turn ends at its budget or on EOS"
                assert versions == sorted(versions) and set(versions) <= {0, 1}
                if mode == "abort" and len(set(versions)) == 2:
                    spanning += 1
                    # Each segment's logprobs are those of the weights its version names (tempered at
                    # 0.8), the continuation's prompt holding the tokens made before the abort.
                    ids = trajectory["input_ids"]
                    change = output_start + versions.index(1)
                    for start, stop, version in ((output_start, change, 0), (change, end, 1)):
                        expected = score(models[version], ids[:start], ids[start:stop], 0.8)
                        assert trajectory["logprobs"][start:stop] == pytest.approx(expected, abs=1e-4)
        if mode == "abort":
            assert spanning >= 1, "a turn was cut by the update and continued under the new weights"


@pytest.mark.router
def test_engines_paused_by_the_trainer_for_30_s_mid_turn_lose_no_token(test_tokenizer_dir, tmp_path):
    """The trainer pauses every engine in abort mode for 30 s (slime, verl and AReaL do so around a
    weight update, without the proxy): the turn in flight comes back aborted with its tokens, the
    proxy resubmits it, the engine holds it until the trainer continues, and the turn ends as one:
    every token once, each with the logprob the engine's model gives it in context."""
    from rolloutfleet_testkit.sglang_emulator.model import load_model, score
    from transformers import AutoTokenizer

    pause_s = 30.0
    tokenizer = AutoTokenizer.from_pretrained(str(test_tokenizer_dir))
    model = load_model(len(tokenizer), seed=0, eos_token_id=tokenizer.eos_token_id)
    with (
        routed_emulators(test_tokenizer_dir, tmp_path, token_delay_s=0.05) as (router_url, engines),
        running_proxy(router_url, test_tokenizer_dir, None) as proxy,
    ):
        sid, key = proxy.create_session()
        answer: list[httpx.Response] = []
        body = {"messages": [{"role": "user", "content": "tell me more"}], "max_tokens": 40, "temperature": 0}
        turn = threading.Thread(
            target=lambda: answer.append(
                httpx.post(
                    f"{proxy.url}/v1/sessions/{sid}/chat/completions",
                    headers={"Authorization": f"Bearer {key}"},
                    json=body,
                    timeout=pause_s + 60,
                )
            )
        )
        turn.start()
        deadline = time.monotonic() + 30
        while not any(httpx.get(f"{e}/emulator_stats").json()["generated_tokens"] >= 5 for e in engines):
            assert time.monotonic() < deadline, "the turn never generated"
            time.sleep(0.02)
        for engine in engines:
            assert httpx.post(f"{engine}/pause_generation", json={"mode": "abort"}).status_code == 200
        time.sleep(pause_s)
        assert not answer, "the turn waited for the engine"
        for engine in engines:
            assert httpx.post(f"{engine}/continue_generation", json={}).status_code == 200
        turn.join(60)
        assert answer and answer[0].status_code == 200, answer and answer[0].text
        trajectory = proxy.get(sid, key).json()["trajectory"]
        ((_, output_start, end),) = trajectory["turns"]
        ids = trajectory["input_ids"]
        assert end - output_start == 40 or ids[end - 1] == tokenizer.eos_token_id
        totals = proxy.stats()["totals"]
        # Two generations made the turn: the one the pause aborted, and its continuation, whose
        # prompt holds the tokens made before (scored as such: the emulator's EOS bonus counts
        # output positions from each generation's start).
        cut = output_start + totals["generated_tokens_continued"]
        expected = score(model, ids[:output_start], ids[output_start:cut], 0) + score(
            model, ids[:cut], ids[cut:end], 0
        )
        assert trajectory["logprobs"][output_start:end] == pytest.approx(expected, abs=1e-4)
        assert totals["generated_tokens_discarded"] == 0 and totals["generated_tokens_continued"] >= 1
        assert totals["turns_continued"] == 1
