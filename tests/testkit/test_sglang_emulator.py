"""The SGLang emulator (a test stand-in for GPU SGLang servers) behaves as SGLang's source says, one
behaviour per test; each names the SGLang function it follows. Real uvicorn servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest
from rolloutfleet_testkit.processes import serve_app
from rolloutfleet_testkit.sglang_emulator.model import load_model, score
from rolloutfleet_testkit.sglang_emulator.protocol import BadRequest, parse_sampling
from rolloutfleet_testkit.sglang_emulator.radix_cache import RadixCache
from rolloutfleet_testkit.sglang_emulator.server import create_app, write_weights
from transformers import AutoTokenizer


@pytest.fixture(scope="module")
def tokenizer(test_tokenizer_dir):
    return AutoTokenizer.from_pretrained(str(test_tokenizer_dir))


@contextlib.contextmanager
def emulator(test_tokenizer_dir, **options) -> Iterator[str]:
    with serve_app(create_app(str(test_tokenizer_dir), seed=0, **options)) as url:
        yield url


def prompt_ids(tokenizer, text: str = "Tell me a long story about rivers and stones.") -> list[int]:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )["input_ids"]


async def generate(client: httpx.AsyncClient, url: str, ids: list[int], **sampling) -> httpx.Response:
    body = {"input_ids": ids, "sampling_params": sampling, "return_logprob": True}
    return await client.post(f"{url}/generate", json=body)


# --- TokenizerManager._validate_one_request: the context length ---------------------------------


async def test_context_length_400s_with_sglangs_messages(test_tokenizer_dir, tokenizer):
    ids = prompt_ids(tokenizer)
    with emulator(test_tokenizer_dir, context_length=len(ids) + 10) as url:
        async with httpx.AsyncClient(timeout=30) as client:
            too_long = await generate(client, url, ids + [5] * 10, max_new_tokens=1)
            assert too_long.status_code == 400
            assert too_long.json()["error"]["message"] == (
                f"The input ({len(ids) + 10} tokens) is longer than the model's context length "
                f"({len(ids) + 10} tokens)."
            )
            total = await generate(client, url, ids, max_new_tokens=10)  # input + 10 >= context
            assert total.status_code == 400
            message = total.json()["error"]["message"]
            assert message.startswith("Requested token count exceeds the model's maximum context length")
            assert f"{len(ids)} tokens from the input messages and 10 tokens for the completion" in message
            assert (await generate(client, url, ids, max_new_tokens=9)).status_code == 200


# --- SamplingParams.__init__ / verify ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"temperature": -0.1}, "temperature must be non-negative"),
        ({"top_p": 0}, "top_p must be in (0, 1]"),
        ({"top_k": 0}, "top_k must be -1 (disable), or at least 1, got 0."),
        ({"min_p": 1.5}, "min_p must be in [0, 1]"),
        ({"repetition_penalty": 0}, "repetition_penalty must be in (0, 2]"),
        ({"frequency_penalty": 3}, "frequency_penalty must be in [-2, 2]"),
        ({"max_new_tokens": -1}, "max_new_tokens must be at least 0"),
        ({"seed": 1}, "unexpected keyword argument 'seed'"),
    ],
)
def test_sampling_params_are_verified_as_sglang_does(params, message):
    with pytest.raises(BadRequest) as refused:
        parse_sampling(params, eos_token_id=2, vocab_size=100)
    assert message in str(refused.value)


def test_sampling_defaults_follow_sglang():
    sampling = parse_sampling({}, eos_token_id=2, vocab_size=100)
    assert (sampling.max_new_tokens, sampling.temperature, sampling.top_k) == (128, 1.0, -1)
    assert parse_sampling({"temperature": 1e-7}, 2, 100).temperature == 0  # below _SAMPLING_EPS: greedy
    assert 2 in parse_sampling({"stop_token_ids": [7]}, 2, 100).stop_token_ids  # adds to EOS
    assert 2 not in parse_sampling({"ignore_eos": True}, 2, 100).stop_token_ids


# --- Sampler.forward: tempered logprobs --------------------------------------------------------------


async def test_logprobs_are_tempered_when_sampling_and_raw_when_greedy(
    test_tokenizer_dir, tokenizer, monkeypatch
):
    model = load_model(len(tokenizer), seed=0, eos_token_id=tokenizer.eos_token_id)
    ids = prompt_ids(tokenizer)
    with emulator(test_tokenizer_dir) as url:
        async with httpx.AsyncClient(timeout=60) as client:
            sampled = (await generate(client, url, ids, max_new_tokens=12, temperature=0.6)).json()
            greedy = (await generate(client, url, ids, max_new_tokens=12, temperature=0)).json()
    for answer, temperature in ((sampled, 0.6), (greedy, 0)):
        logprobs = [entry[0] for entry in answer["meta_info"]["output_token_logprobs"]]
        assert logprobs == pytest.approx(score(model, ids, answer["output_ids"], temperature), abs=1e-5)
    raw = score(model, ids, sampled["output_ids"], 1.0)
    assert [e[0] for e in sampled["meta_info"]["output_token_logprobs"]] != pytest.approx(raw, abs=1e-3)
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    with emulator(test_tokenizer_dir) as url:
        async with httpx.AsyncClient(timeout=60) as client:
            original = (await generate(client, url, ids, max_new_tokens=12, temperature=0.6)).json()
    logprobs = [entry[0] for entry in original["meta_info"]["output_token_logprobs"]]
    assert logprobs == pytest.approx(score(model, ids, original["output_ids"], 1.0), abs=1e-5)


# --- Req.check_finished: length before EOS; stop strings ----------------------------------------------


async def test_eos_as_the_last_allowed_token_is_a_length_finish(test_tokenizer_dir, tokenizer):
    ids = prompt_ids(tokenizer)
    with emulator(test_tokenizer_dir) as url:
        async with httpx.AsyncClient(timeout=60) as client:
            full = (await generate(client, url, ids, max_new_tokens=200, temperature=0)).json()
            assert full["output_ids"][-1] == tokenizer.eos_token_id
            n = len(full["output_ids"])
            assert full["meta_info"]["finish_reason"] == {"type": "stop", "matched": tokenizer.eos_token_id}
            capped = (await generate(client, url, ids, max_new_tokens=n, temperature=0)).json()
    assert capped["output_ids"] == full["output_ids"]
    assert capped["meta_info"]["finish_reason"] == {"type": "length", "length": n}


async def test_stop_strings_keep_their_tokens_and_trim_the_text(test_tokenizer_dir, tokenizer):
    ids = prompt_ids(tokenizer)
    with emulator(test_tokenizer_dir) as url:
        async with httpx.AsyncClient(timeout=60) as client:
            full = (
                await generate(client, url, ids, max_new_tokens=40, temperature=0, ignore_eos=True)
            ).json()
            text = full["text"]
            stop = text[len(text) // 2 : len(text) // 2 + 2]
            assert stop.strip(), text
            stopped = await generate(client, url, ids, max_new_tokens=40, temperature=0, stop=[stop])
            untrimmed = await generate(
                client, url, ids, max_new_tokens=40, temperature=0, stop=[stop], no_stop_trim=True
            )
    answer = stopped.json()
    assert answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop in tokenizer.decode(answer["output_ids"], skip_special_tokens=True)  # tokens kept
    assert answer["text"] == text[: text.find(stop)]
    assert len(answer["meta_info"]["output_token_logprobs"]) == len(answer["output_ids"])
    assert stop in untrimmed.json()["text"]


# --- RadixCache: cached_tokens, capacity, flush -------------------------------------------------------


def test_radix_cache_matches_evicts_least_recently_used_and_never_the_last_token():
    cache = RadixCache(capacity_tokens=10)
    cache.insert([1, 2, 3, 4, 5, 6])
    assert cache.cached_tokens([1, 2, 3, 4, 5, 6, 7]) == 6
    assert cache.cached_tokens([1, 2, 3]) == 2  # at most len(input) - 1
    cache.insert([9, 8, 7, 6])  # 10 tokens: full
    cache.match_prefix([9, 8, 7, 6])  # touched: [1..6]'s tail is now the least recently used
    cache.insert([1, 2, 3, 0])  # one more token: evicts from [1..6]'s leaf
    assert cache.size == 10
    assert cache.cached_tokens([9, 8, 7, 6, 0]) == 4
    assert cache.cached_tokens([1, 2, 3, 4, 5, 6, 7]) == 5
    cache.reset()
    assert cache.cached_tokens([1, 2, 3, 4]) == 0


async def test_a_session_turn_reports_its_history_as_cached_tokens(test_tokenizer_dir, tokenizer):
    ids = prompt_ids(tokenizer)
    with emulator(test_tokenizer_dir) as url:
        async with httpx.AsyncClient(timeout=60) as client:
            first = (await generate(client, url, ids, max_new_tokens=8, temperature=0)).json()
            assert first["meta_info"]["cached_tokens"] == 0
            history = ids + first["output_ids"]
            second = (await generate(client, url, [*history, 5, 6], max_new_tokens=4, temperature=0)).json()
            # cache_finished_req kept (input + output)[:-1]
            assert second["meta_info"]["cached_tokens"] == len(history) - 1
            assert (await client.post(f"{url}/flush_cache")).status_code == 200
            third = (await generate(client, url, [*history, 5, 6], max_new_tokens=4, temperature=0)).json()
            assert third["meta_info"]["cached_tokens"] == 0
            stats = (await client.get(f"{url}/emulator_stats")).json()
            assert stats["cached_tokens"] == len(history) - 1 and stats["requests"] == 3


# --- TokenizerManager.pause_generation / continue_generation / update_weights_from_disk ------------------


async def _wait_running(client: httpx.AsyncClient, url: str, count: int) -> None:
    deadline = time.monotonic() + 20
    while (await client.get(f"{url}/emulator_stats")).json()["running"] < count:
        assert time.monotonic() < deadline, "requests never started"
        await asyncio.sleep(0.02)


async def test_pause_in_abort_mode_answers_200_with_the_partial_tokens(test_tokenizer_dir, tokenizer):
    ids = prompt_ids(tokenizer)
    model = load_model(len(tokenizer), seed=0, eos_token_id=tokenizer.eos_token_id)
    with emulator(test_tokenizer_dir, token_delay_s=0.02) as url:
        async with httpx.AsyncClient(timeout=60) as client:
            running = asyncio.create_task(
                generate(client, url, ids, max_new_tokens=200, temperature=0, ignore_eos=True)
            )
            await _wait_running(client, url, 1)
            await asyncio.sleep(0.2)
            paused = await client.post(f"{url}/pause_generation", json={"mode": "abort"})
            assert paused.status_code == 200
            answer = (await running).json()
            assert answer["meta_info"]["finish_reason"]["type"] == "abort"
            partial = answer["output_ids"]
            assert 0 < len(partial) < 200
            logprobs = [e[0] for e in answer["meta_info"]["output_token_logprobs"]]
            assert logprobs == pytest.approx(score(model, ids, partial, 0), abs=1e-5)
            # A new request waits while paused (is_pause_cond), then runs after the resume.
            waiting = asyncio.create_task(generate(client, url, ids, max_new_tokens=3, temperature=0))
            await asyncio.sleep(0.3)
            assert not waiting.done()
            await client.post(f"{url}/continue_generation")
            assert (await waiting).status_code == 200
            unpaused = (
                await generate(client, url, ids, max_new_tokens=200, temperature=0, ignore_eos=True)
            ).json()
    assert unpaused["output_ids"][: len(partial)] == partial


@pytest.mark.parametrize("mode", ["in_place", "retract"])
async def test_in_place_and_retract_hold_requests_and_finish_them_under_the_new_weights(
    mode, test_tokenizer_dir, tokenizer, tmp_path
):
    """pause_generation(in_place) keeps a request's state in the batch; retract sends it back to be
    prefilled again. Both finish after continue_generation, under the weights loaded meanwhile
    (update_weights_from_disk while paused loads at once), reporting the version at their end."""
    ids = prompt_ids(tokenizer)
    old = load_model(len(tokenizer), seed=0, eos_token_id=tokenizer.eos_token_id)
    new = load_model(len(tokenizer), seed=7, eos_token_id=tokenizer.eos_token_id)
    weights = write_weights(tmp_path / "v7", seed=7)
    with emulator(test_tokenizer_dir, token_delay_s=0.02) as url:
        async with httpx.AsyncClient(timeout=60) as client:
            running = asyncio.create_task(
                generate(client, url, ids, max_new_tokens=60, temperature=0, ignore_eos=True)
            )
            await _wait_running(client, url, 1)
            await asyncio.sleep(0.2)
            await client.post(f"{url}/pause_generation", json={"mode": mode})
            made = (await client.get(f"{url}/emulator_stats")).json()["generated_tokens"]
            await asyncio.sleep(0.3)
            assert not running.done()
            assert (await client.get(f"{url}/emulator_stats")).json()["generated_tokens"] == made
            update = await client.post(
                f"{url}/update_weights_from_disk", json={"model_path": str(weights), "weight_version": "7"}
            )
            assert update.status_code == 200 and update.json()["success"] is True
            assert update.json()["num_paused_requests"] == 1
            await client.post(f"{url}/continue_generation")
            answer = (await running).json()
    assert answer["meta_info"]["finish_reason"] == {"type": "length", "length": 60}
    assert answer["meta_info"]["weight_version"] == "7"  # the version at the end of the request
    out = answer["output_ids"]
    logprobs = [e[0] for e in answer["meta_info"]["output_token_logprobs"]]
    assert 0 < made < 60
    assert logprobs[:made] == pytest.approx(score(old, ids, out[:made], 0), abs=1e-5)
    assert logprobs != pytest.approx(score(old, ids, out, 0), abs=1e-4)
    if mode == "retract":  # prefilled again under the new weights: the rest is the new model's
        assert logprobs[made:] == pytest.approx(score(new, ids, out, 0)[made:], abs=1e-4)


async def test_update_weights_changes_the_model_the_version_and_flushes_the_cache(
    test_tokenizer_dir, tokenizer, tmp_path
):
    ids = prompt_ids(tokenizer)
    new = load_model(len(tokenizer), seed=11, eos_token_id=tokenizer.eos_token_id)
    with emulator(test_tokenizer_dir) as url:
        async with httpx.AsyncClient(timeout=60) as client:
            before = (await generate(client, url, ids, max_new_tokens=8, temperature=0)).json()
            assert before["meta_info"]["weight_version"] == "default"
            path = write_weights(tmp_path / "w", seed=11)
            body = {"model_path": str(path), "weight_version": "3"}
            assert (await client.post(f"{url}/update_weights_from_disk", json=body)).json()["success"]
            after = (await generate(client, url, ids, max_new_tokens=8, temperature=0)).json()
            assert (await client.get(f"{url}/get_weight_version")).json() == {"weight_version": "3"}
            bad = await client.post(
                f"{url}/update_weights_from_disk", json={"model_path": str(tmp_path / "x")}
            )
            assert bad.status_code == 400
            await client.post(f"{url}/update_weight_version", json={"new_version": "4"})
            assert (await client.get(f"{url}/get_weight_version")).json() == {"weight_version": "4"}
    assert after["meta_info"]["weight_version"] == "3"
    assert after["meta_info"]["cached_tokens"] == 0  # flushed
    assert after["output_ids"] != before["output_ids"]
    logprobs = [e[0] for e in after["meta_info"]["output_token_logprobs"]]
    assert logprobs == pytest.approx(score(new, ids, after["output_ids"], 0), abs=1e-5)


async def test_abort_request_by_rid_and_client_disconnect_abort(test_tokenizer_dir, tokenizer):
    ids = prompt_ids(tokenizer)
    with emulator(test_tokenizer_dir, token_delay_s=0.02) as url:
        async with httpx.AsyncClient(timeout=60) as client:
            body = {
                "input_ids": ids,
                "rid": "r-1",
                "sampling_params": {"max_new_tokens": 500, "ignore_eos": True},
            }
            running = asyncio.create_task(client.post(f"{url}/generate", json=body))
            await _wait_running(client, url, 1)
            assert (await client.post(f"{url}/abort_request", json={"rid": "r-1"})).status_code == 200
            answer = (await running).json()
            assert answer["meta_info"]["id"] == "r-1"
            assert answer["meta_info"]["finish_reason"]["type"] == "abort"
            # A client that goes away: SGLang aborts its request (the engine is free again).
            async with httpx.AsyncClient(timeout=0.5) as impatient:
                with pytest.raises(httpx.ReadTimeout):
                    await impatient.post(f"{url}/generate", json={**body, "rid": "r-2"})
            deadline = time.monotonic() + 10
            while (await client.get(f"{url}/emulator_stats")).json()["running"]:
                assert time.monotonic() < deadline, "the abandoned request kept running"
                await asyncio.sleep(0.1)


# --- health_generate ------------------------------------------------------------------------------


async def test_health_generates_and_waits_behind_a_pause_unless_switched_off(test_tokenizer_dir, monkeypatch):
    with emulator(test_tokenizer_dir, health_timeout_s=0.5) as url:
        async with httpx.AsyncClient(timeout=30) as client:
            assert (await client.get(f"{url}/health")).status_code == 200
            await client.post(f"{url}/pause_generation", json={"mode": "in_place"})
            started = time.monotonic()
            assert (await client.get(f"{url}/health")).status_code == 503
            assert time.monotonic() - started >= 0.5
            assert (await client.get(f"{url}/health_generate")).status_code == 503
            await client.post(f"{url}/continue_generation")
            assert (await client.get(f"{url}/health")).status_code == 200
    monkeypatch.setenv("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "0")
    with emulator(test_tokenizer_dir, health_timeout_s=0.5) as url:
        async with httpx.AsyncClient(timeout=30) as client:
            await client.post(f"{url}/pause_generation", json={"mode": "in_place"})
            started = time.monotonic()
            assert (await client.get(f"{url}/health")).status_code == 200
            assert time.monotonic() - started < 0.4
            assert (await client.get(f"{url}/health_generate")).status_code == 503


# --- Parallel sampling: sampling_params.n ------------------------------------------------------------


def _logprobs(answer: dict) -> list[float]:
    return [entry[0] for entry in answer["meta_info"]["output_token_logprobs"]]


async def test_n_answers_a_list_of_independent_samples_after_caching_the_prompt(
    test_tokenizer_dir, tokenizer
):
    """GenerateReqInput._handle_parallel_sampling turns a prompt with n > 1 into a batch;
    TokenizerManager._handle_batch_request first sends the prompt with max_new_tokens 0 ("Cache the
    common prefix for parallel sampling"), then n requests, each with a rid of its own
    (regenerate_rid: a uuid4 hex, never the request's rid); _collect_batch_responses answers their
    results as one JSON list in that order."""
    ids = prompt_ids(tokenizer)
    model = load_model(len(tokenizer), seed=0, eos_token_id=tokenizer.eos_token_id)
    with emulator(test_tokenizer_dir) as url:
        async with httpx.AsyncClient(timeout=60) as client:
            body = {
                "input_ids": ids,
                "rid": "group-1",
                "return_logprob": True,
                "sampling_params": {"n": 4, "max_new_tokens": 24, "temperature": 0.9},
            }
            response = await client.post(f"{url}/generate", json=body)
            stats = (await client.get(f"{url}/emulator_stats")).json()
            greedy = await client.post(
                f"{url}/generate", json={**body, "sampling_params": {"n": 3, "temperature": 0}}
            )
    assert response.status_code == 200
    samples = response.json()
    assert isinstance(samples, list) and len(samples) == 4
    rids = [sample["meta_info"]["id"] for sample in samples]
    assert len(set(rids)) == 4 and all(len(rid) == 32 and "group-1" not in rid for rid in rids)
    # Each sample draws its own tokens (temperature > 0), with its own logprobs and finish reason.
    assert len({tuple(sample["output_ids"]) for sample in samples}) == 4
    for sample in samples:
        out, meta = sample["output_ids"], sample["meta_info"]
        assert _logprobs(sample) == pytest.approx(score(model, ids, out, 0.9), abs=1e-5)
        if out[-1] == tokenizer.eos_token_id:
            assert meta["finish_reason"] == {"type": "stop", "matched": tokenizer.eos_token_id}
        else:
            assert meta["finish_reason"] == {"type": "length", "length": 24} and len(out) == 24
        assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(ids), len(out))
        # On a fresh engine too: the prefill-only request cached the prompt before the samples ran.
        assert meta["cached_tokens"] == len(ids) - 1
    assert stats["requests"] == 1 + 4  # the prefill-only request and the four samples
    # Greedy samples are all the argmax path.
    assert len({tuple(sample["output_ids"]) for sample in greedy.json()}) == 1


@pytest.mark.parametrize("n", [1, 0, -3, True])
async def test_n_of_one_or_less_is_a_single_request(n, test_tokenizer_dir, tokenizer):
    """_handle_parallel_sampling makes a batch only for parallel_sample_num > 1: otherwise the request
    stays single (_normalize_single_inputs keeps its rid) and answers one object."""
    with emulator(test_tokenizer_dir) as url:
        async with httpx.AsyncClient(timeout=60) as client:
            body = {
                "input_ids": prompt_ids(tokenizer),
                "rid": "one",
                "sampling_params": {"n": n, "max_new_tokens": 3},
            }
            answer = (await client.post(f"{url}/generate", json=body)).json()
    assert isinstance(answer, dict) and answer["meta_info"]["id"] == "one"


@pytest.mark.parametrize("n", [None, "2", 2.0])
async def test_n_that_is_no_integer_fails_with_500(n, test_tokenizer_dir, tokenizer):
    """_handle_parallel_sampling compares n with 1 and _normalize_rid ranges over n times the batch size,
    unchecked: a TypeError, which SGLang's server answers as an unhandled exception (HTTP 500)."""
    with emulator(test_tokenizer_dir) as url:
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"input_ids": prompt_ids(tokenizer), "sampling_params": {"n": n, "max_new_tokens": 3}}
            assert (await client.post(f"{url}/generate", json=body)).status_code == 500


def _events(raw: str) -> list[str]:
    events = [block for block in raw.split("\n\n") if block]
    assert all(event.startswith("data: ") for event in events), events[:3]
    return [event[len("data: ") :] for event in events]


async def test_a_streamed_group_interleaves_its_samples_each_chunk_with_its_index(
    test_tokenizer_dir, tokenizer
):
    """TokenizerManager._stream_batch_responses yields each sample's chunks as they come and sets
    `index` (the sample's place in the group) on every one; each sample streams as a single request
    does (cumulative text and ids, the last chunk with the finish); then `data: [DONE]`."""
    ids = prompt_ids(tokenizer)
    model = load_model(len(tokenizer), seed=0, eos_token_id=tokenizer.eos_token_id)
    with emulator(test_tokenizer_dir) as url:
        async with httpx.AsyncClient(timeout=60) as client:
            body = {
                "input_ids": ids,
                "return_logprob": True,
                "stream": True,
                "sampling_params": {"n": 3, "max_new_tokens": 10, "temperature": 1.0, "ignore_eos": True},
            }
            raw = (await client.post(f"{url}/generate", json=body)).text
    events = _events(raw)
    assert events[-1] == "[DONE]"
    by_index: dict[int, list[dict]] = {}
    positions: dict[int, list[int]] = {}
    for position, event in enumerate(events[:-1]):
        chunk = orjson.loads(event)
        by_index.setdefault(chunk["index"], []).append(chunk)
        positions.setdefault(chunk["index"], []).append(position)
    assert sorted(by_index) == [0, 1, 2]
    assert len({chunks[0]["meta_info"]["id"] for chunks in by_index.values()}) == 3
    for chunks in by_index.values():
        assert len({chunk["meta_info"]["id"] for chunk in chunks}) == 1
        assert [len(chunk["output_ids"]) for chunk in chunks] == list(range(1, 11))
        assert all(chunk["meta_info"]["finish_reason"] is None for chunk in chunks[:-1])
        last = chunks[-1]
        assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
        assert all(last["output_ids"][: len(c["output_ids"])] == c["output_ids"] for c in chunks)
        assert _logprobs(last) == pytest.approx(score(model, ids, last["output_ids"], 1.0), abs=1e-5)
    # The samples' chunks interleave: every sample has streamed before any one has finished.
    assert max(at[0] for at in positions.values()) < min(at[-1] for at in positions.values())


async def test_pause_in_abort_mode_aborts_every_sample_of_a_group(test_tokenizer_dir, tokenizer):
    """pause_generation(abort) aborts all requests (abort_request(abort_all=True)): each of a group's
    samples ends with finish abort and its own tokens so far; the group still answers HTTP 200 with the
    list of all n results (_wait_one_response yields an abort without an error status as a result)."""
    ids = prompt_ids(tokenizer)
    model = load_model(len(tokenizer), seed=0, eos_token_id=tokenizer.eos_token_id)
    with emulator(test_tokenizer_dir, token_delay_s=0.02) as url:
        async with httpx.AsyncClient(timeout=60) as client:
            body = {
                "input_ids": ids,
                "return_logprob": True,
                "sampling_params": {"n": 3, "max_new_tokens": 300, "temperature": 0.7, "ignore_eos": True},
            }
            running = asyncio.create_task(client.post(f"{url}/generate", json=body))
            await _wait_running(client, url, 3)
            await asyncio.sleep(0.2)
            assert (await client.post(f"{url}/pause_generation", json={"mode": "abort"})).status_code == 200
            response = await running
            await client.post(f"{url}/continue_generation")
    assert response.status_code == 200
    samples = response.json()
    assert len(samples) == 3
    for sample in samples:
        assert sample["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < len(sample["output_ids"]) < 300
        assert _logprobs(sample) == pytest.approx(score(model, ids, sample["output_ids"], 0.7), abs=1e-5)


async def test_the_requests_rid_aborts_no_sample_and_a_samples_own_rid_aborts_only_it(
    test_tokenizer_dir, tokenizer
):
    """TokenizerManager.abort_request returns at once for a rid it holds no state for: the samples run
    under regenerated rids, so aborting the request's rid stops nothing. A sample's own rid (its
    streamed meta_info.id) aborts that sample alone."""
    with emulator(test_tokenizer_dir, token_delay_s=0.02) as url:
        async with httpx.AsyncClient(timeout=60) as client:
            body = {
                "input_ids": prompt_ids(tokenizer),
                "rid": "group-2",
                "stream": True,
                "sampling_params": {"n": 2, "max_new_tokens": 60, "ignore_eos": True},
            }
            chunks: list[dict] = []
            async with client.stream("POST", f"{url}/generate", json=body) as response:
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunks.append(orjson.loads(line[len("data: ") :]))
                    if len(chunks) == 1:
                        assert (
                            await client.post(f"{url}/abort_request", json={"rid": "group-2"})
                        ).status_code == 200
                        await asyncio.sleep(0.2)
                        stats = (await client.get(f"{url}/emulator_stats")).json()
                        assert (stats["aborted"], stats["running"]) == (0, 2)
                        victim = chunks[0]["meta_info"]["id"]
                        await client.post(f"{url}/abort_request", json={"rid": victim})
    last = {chunk["index"]: chunk for chunk in chunks}
    aborted = chunks[0]["index"]
    assert last[aborted]["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(last[aborted]["output_ids"]) < 60
    assert last[1 - aborted]["meta_info"]["finish_reason"] == {"type": "length", "length": 60}


async def test_a_client_that_goes_away_aborts_every_sample(test_tokenizer_dir, tokenizer):
    """Each sample's _wait_one_response aborts its own rid when the client has disconnected."""
    with emulator(test_tokenizer_dir, token_delay_s=0.02) as url:
        async with httpx.AsyncClient(timeout=60) as client:
            body = {
                "input_ids": prompt_ids(tokenizer),
                "sampling_params": {"n": 3, "max_new_tokens": 500, "ignore_eos": True},
            }
            async with httpx.AsyncClient(timeout=0.5) as impatient:
                with pytest.raises(httpx.ReadTimeout):
                    await impatient.post(f"{url}/generate", json=body)
            deadline = time.monotonic() + 10
            while (stats := (await client.get(f"{url}/emulator_stats")).json())["running"]:
                assert time.monotonic() < deadline, "the abandoned samples kept running"
                await asyncio.sleep(0.1)
    assert stats["aborted"] == 3


@pytest.mark.parametrize("deterministic", [True, False])
async def test_one_sampling_seed_makes_the_samples_alike_under_deterministic_inference(
    deterministic, test_tokenizer_dir, tokenizer
):
    """_normalize_sampling_params gives every sample the same sampling_params, and
    SamplingBatchInfo.from_schedule_batch seeds each row with its request's sampling_seed when
    deterministic inference is on: n samples with one seed are n copies of the seed's one sequence.
    Without deterministic inference the seed is ignored and the samples differ."""
    ids = prompt_ids(tokenizer)
    with emulator(test_tokenizer_dir, deterministic_inference=deterministic) as url:
        async with httpx.AsyncClient(timeout=60) as client:
            params = {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 7}
            body = {"input_ids": ids, "sampling_params": {**params, "n": 3}}
            samples = (await client.post(f"{url}/generate", json=body)).json()
            single = (
                await client.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": params})
            ).json()
    distinct = {tuple(sample["output_ids"]) for sample in samples}
    if deterministic:
        assert distinct == {tuple(single["output_ids"])}
    else:
        assert len(distinct) == 3


async def test_max_new_tokens_zero_is_prefill_only_and_caches_the_prompt(test_tokenizer_dir, tokenizer):
    """Req.is_prefill_only (max_new_tokens 0): check_finished ends it with length 0 right after the
    prefill, and cache_finished_req keeps its whole input, which a later request then reports as
    cached (all but its last token, Req.init_next_round_input). Streamed, it is one final chunk."""
    ids = prompt_ids(tokenizer)
    with emulator(test_tokenizer_dir) as url:
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}}
            prefill = (await client.post(f"{url}/generate", json=body)).json()
            streamed = (await client.post(f"{url}/generate", json={**body, "stream": True})).text
            after = (
                await client.post(f"{url}/generate", json={**body, "sampling_params": {"max_new_tokens": 2}})
            ).json()
    assert prefill["output_ids"] == [] and prefill["meta_info"]["finish_reason"] == {
        "type": "length",
        "length": 0,
    }
    assert prefill["meta_info"]["cached_tokens"] == 0
    events = _events(streamed)
    assert len(events) == 2 and events[-1] == "[DONE]"
    assert orjson.loads(events[0])["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert after["meta_info"]["cached_tokens"] == len(ids) - 1


@pytest.mark.router
async def test_the_real_router_passes_n_and_the_groups_answers_through(
    test_tokenizer_dir, tokenizer, tmp_path
):
    """sglang-router 0.3.2 re-serializes /generate through its typed GenerateRequest, whose
    SamplingParams (19 fields) has `n: Option<u32>`: n reaches the engine, a negative n is refused by the
    router itself (422, a u32 field), and the engine's list and streamed chunks come back unchanged."""
    from rolloutfleet_testkit.routed_engines import routed_emulators

    ids = prompt_ids(tokenizer)
    with routed_emulators(test_tokenizer_dir, tmp_path, count=1) as (router_url, _engines):
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"input_ids": ids, "rid": "g", "sampling_params": {"n": 2, "max_new_tokens": 4}}
            group = await client.post(f"{router_url}/generate", json=body)
            streamed = await client.post(f"{router_url}/generate", json={**body, "stream": True})
            negative = await client.post(
                f"{router_url}/generate", json={**body, "sampling_params": {"n": -1, "max_new_tokens": 4}}
            )
    assert group.status_code == 200 and len(group.json()) == 2
    chunks = [orjson.loads(event) for event in _events(streamed.text)[:-1]]
    assert sorted({chunk["index"] for chunk in chunks}) == [0, 1] and len(chunks) == 2 * 4
    assert negative.status_code == 422 and "sampling_params.n" in negative.text
