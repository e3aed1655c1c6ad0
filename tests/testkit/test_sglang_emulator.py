"""The SGLang emulator (a test stand-in for GPU SGLang servers) behaves as SGLang's source says, one
behaviour per test; each names the SGLang function it follows. Real uvicorn servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

import httpx
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
