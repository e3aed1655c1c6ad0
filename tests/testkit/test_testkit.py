"""The test kit: test tokenizer, CPU reference engine (model and server), upstream stub, and the
real sglang-router in front of the engine."""

from __future__ import annotations

import asyncio
import pathlib
import shutil
import sys
import time
from collections.abc import Mapping

import httpx
import orjson
import pytest
import torch
from rolloutfleet_testkit import tokenizer_builder
from rolloutfleet_testkit.processes import ServerProcess, free_port, serve_app, wait_http_ok
from rolloutfleet_testkit.sglang_emulator import server as engine_server
from rolloutfleet_testkit.sglang_emulator.model import TinyCausalLM, generate, load_model, score
from rolloutfleet_testkit.tokenizer_builder import build_test_tokenizer
from rolloutfleet_testkit.upstream_stub import TOKEN_LOGPROB
from rolloutfleet_testkit.upstream_stub import create_app as create_stub

MESSAGES = [
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": "What is two plus three?"},
]


@pytest.fixture(scope="module")
def tokenizer(test_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(test_tokenizer_dir)


@pytest.fixture(scope="module")
def model(test_tokenizer_dir) -> TinyCausalLM:
    # The same model the session's reference engine serves (seed 0).
    return load_model(test_tokenizer_dir, seed=0)


def _chat_ids(tokenizer, messages, add_generation_prompt=True) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    return list(out["input_ids"] if isinstance(out, Mapping) else out)


# --- tokenizer ---------------------------------------------------------------------------------


def test_tokenizer_special_tokens(tokenizer):
    assert 900 <= len(tokenizer) <= 1100
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        ids = tokenizer.encode(special, add_special_tokens=False)
        assert len(ids) == 1, special
        assert tokenizer.convert_ids_to_tokens(ids[0]) == special


@pytest.mark.parametrize(
    "text",
    [
        "The server answered the request.",
        "héllo wörld — “quoted” ½ café",
        "你好\uff0c世界。こんにちは 안녕하세요",
        "emoji 🙂👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
        "tabs\tnewlines\ncarriage\r\n  spaces  ",
        "combining e\u0301 and zero\u200bwidth, nul \x00 del \x7f",
        "Ελληνικά, русский, עברית, العربية",
    ],
)
def test_tokenizer_round_trips_unicode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert all(0 <= i < len(tokenizer) for i in ids)
    assert tokenizer.decode(ids) == text


def test_chat_template_is_chatml(tokenizer):
    expected = (
        "<|im_start|>system\nYou are brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is two plus three?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = _chat_ids(tokenizer, MESSAGES)
    assert ids == tokenizer.encode(expected, add_special_tokens=False)
    assert tokenizer.decode(ids) == expected
    # No default system prompt, and no assistant header without add_generation_prompt.
    rendered = tokenizer.apply_chat_template(MESSAGES[1:], add_generation_prompt=False, tokenize=False)
    assert rendered == "<|im_start|>user\nWhat is two plus three?<|im_end|>\n"


def _snapshot(directory: pathlib.Path) -> dict[str, tuple[bytes, int]]:
    return {
        p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(directory.iterdir()) if p.is_file()
    }


def test_tokenizer_build_is_deterministic_and_idempotent(tmp_path, test_tokenizer_dir, capsys):
    out = tmp_path / "tok"
    assert build_test_tokenizer(out) == out
    reference = {name: data for name, (data, _) in _snapshot(test_tokenizer_dir).items()}
    first = _snapshot(out)
    assert {name: data for name, (data, _) in first.items()} == reference
    assert tokenizer_builder.MARKER_NAME in first and "tokenizer.json" in first

    # A complete build is reused untouched (the CLI goes the same way).
    tokenizer_builder.main([str(out)])
    assert capsys.readouterr().out.strip() == str(out)
    assert _snapshot(out) == first

    # A damaged build is rebuilt to the same bytes.
    (out / "tokenizer.json").write_text("{}")
    build_test_tokenizer(out)
    assert {name: data for name, (data, _) in _snapshot(out).items()} == reference


# --- model -------------------------------------------------------------------------------------


def test_weights_come_only_from_the_seed():
    torch.manual_seed(1)
    rng_before = torch.random.get_rng_state()
    a = TinyCausalLM(300, seed=5, eos_token_id=2)
    assert torch.equal(torch.random.get_rng_state(), rng_before), "model init touched the global RNG"
    torch.manual_seed(2)
    b = TinyCausalLM(300, seed=5, eos_token_id=2)
    c = TinyCausalLM(300, seed=6, eos_token_id=2)
    for name, tensor in a.state_dict().items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, b.state_dict()[name]), name
    assert not torch.equal(a.head.weight, c.head.weight)


def test_generate_is_deterministic(model, tokenizer, test_tokenizer_dir):
    prompt = _chat_ids(tokenizer, MESSAGES)
    eos = {tokenizer.eos_token_id}
    greedy = generate(model, prompt, 64, 0.0, 1.0, None, eos)
    assert greedy == generate(model, prompt, 64, 0.0, 1.0, 123, eos)  # greedy ignores the seed
    sampled = generate(model, prompt, 64, 1.0, 1.0, 7, eos)
    assert sampled == generate(model, prompt, 64, 1.0, 1.0, 7, eos)
    assert sampled.output_ids != generate(model, prompt, 64, 1.0, 1.0, 8, eos).output_ids
    # A vanishing top_p keeps only the most likely token: sampling becomes greedy.
    assert generate(model, prompt, 64, 1.0, 1e-9, 7, eos).output_ids == greedy.output_ids
    other_model = load_model(test_tokenizer_dir, seed=1)
    assert generate(other_model, prompt, 64, 0.0, 1.0, None, eos).output_ids != greedy.output_ids


@pytest.mark.parametrize(("temperature", "top_p", "seed"), [(0.0, 1.0, None), (1.0, 1.0, 3), (0.7, 0.9, 11)])
def test_score_matches_generate(model, tokenizer, temperature, top_p, seed):
    prompt = _chat_ids(tokenizer, MESSAGES)
    result = generate(model, prompt, 96, temperature, top_p, seed, {tokenizer.eos_token_id})
    assert len(result.output_ids) == len(result.logprobs) > 1
    assert all(lp <= 0 for lp in result.logprobs)
    scored = score(model, prompt, result.output_ids, temperature)  # tempered when sampling
    assert scored == pytest.approx(result.logprobs, abs=1e-5)
    # The EOS bonus is part of the reported numbers: without it the late positions differ.
    plain = TinyCausalLM(
        model.vocab_size, seed=model.seed, eos_token_id=model.eos_token_id, eos_bonus_per_token=0
    )
    assert score(plain, prompt, result.output_ids)[-1] != pytest.approx(result.logprobs[-1], abs=1e-3)


def test_replies_end_naturally_with_the_stop_token_included(model, tokenizer):
    eos = tokenizer.eos_token_id
    for content in ("Hello!", "Tell me about the river.", "def add(a, b):", "Thank you, 42 times."):
        prompt = _chat_ids(tokenizer, [{"role": "user", "content": content}])
        result = generate(model, prompt, 128, 0.0, 1.0, None, {eos})
        assert result.finish == "stop", content
        assert result.output_ids[-1] == eos and eos not in result.output_ids[:-1]
        assert 5 <= len(result.output_ids) <= 60, (content, len(result.output_ids))


def test_stop_tokens_and_length_limit(model, tokenizer):
    prompt = _chat_ids(tokenizer, MESSAGES)
    full = generate(model, prompt, 128, 0.0, 1.0, None, {tokenizer.eos_token_id})
    # The first position (>= 1) whose token has not appeared before: stopping on it ends there.
    index = next(i for i, t in enumerate(full.output_ids) if i >= 1 and t not in full.output_ids[:i])
    stopped = generate(model, prompt, 128, 0.0, 1.0, None, {full.output_ids[index]})
    assert stopped.output_ids == full.output_ids[: index + 1]
    assert stopped.finish == "stop"
    short = generate(model, prompt, 3, 0.0, 1.0, None, {tokenizer.eos_token_id})
    assert short.output_ids == full.output_ids[:3] and short.finish == "length"
    assert generate(model, prompt, 0, 0.0, 1.0, None, ()) == ([], [], "length")
    with pytest.raises(ValueError):
        generate(model, [model.vocab_size], 4)


# --- reference engine server -------------------------------------------------------------------


async def _post(url: str, body: object, **kwargs) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as client:
        return await client.post(url, json=body, **kwargs)


async def test_generate_answers_in_sglang_shape(sglang_emulator_url, model, tokenizer):
    # The engine is shared by the session: other tests' prompts share the template's first tokens.
    assert (await _post(f"{sglang_emulator_url}/flush_cache", None)).status_code == 200
    prompt = _chat_ids(tokenizer, MESSAGES)
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 96, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": -1,
    }
    response = await _post(f"{sglang_emulator_url}/generate", body)
    assert response.status_code == 200, response.text
    answer = response.json()
    expected = generate(model, prompt, 96, 0.0, 1.0, None, {tokenizer.eos_token_id})
    assert answer["output_ids"] == expected.output_ids
    assert answer["text"] == tokenizer.decode(expected.output_ids, skip_special_tokens=True)
    meta = answer["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": tokenizer.eos_token_id}
    assert meta["prompt_tokens"] == len(prompt)
    assert meta["completion_tokens"] == len(expected.output_ids)
    assert meta["cached_tokens"] == 0
    assert isinstance(meta["e2e_latency"], float) and meta["e2e_latency"] >= 0
    assert len(meta["id"]) == 32 and int(meta["id"], 16) >= 0
    assert [entry[1] for entry in meta["output_token_logprobs"]] == expected.output_ids
    assert [entry[2] for entry in meta["output_token_logprobs"]] == [None] * len(expected.output_ids)
    logprobs = [entry[0] for entry in meta["output_token_logprobs"]]
    assert logprobs == pytest.approx(score(model, prompt, answer["output_ids"]), abs=1e-5)

    # Without return_logprob there are no logprobs; text input means the same as its ids.
    text = "The server answered the request."
    greedy = {"max_new_tokens": 16, "temperature": 0}
    by_text = (
        await _post(f"{sglang_emulator_url}/generate", {"text": text, "sampling_params": greedy})
    ).json()
    by_ids = {"input_ids": tokenizer.encode(text), "sampling_params": greedy}
    by_ids = (await _post(f"{sglang_emulator_url}/generate", by_ids)).json()
    assert "output_token_logprobs" not in by_text["meta_info"]
    assert by_text["output_ids"] == by_ids["output_ids"]


async def test_generate_sampling_follows_the_seed_in_deterministic_mode(
    sglang_emulator_url, model, tokenizer
):
    """sampling_seed counts with --enable-deterministic-inference (the fixture's engine); logprobs are
    log_softmax(logits / temperature) on the sampling path (Sampler.forward)."""
    prompt = _chat_ids(tokenizer, MESSAGES)
    params = {"max_new_tokens": 64, "temperature": 0.8, "top_p": 0.9, "sampling_seed": 5}
    body = {"input_ids": prompt, "return_logprob": True, "sampling_params": params}
    answer = (await _post(f"{sglang_emulator_url}/generate", body)).json()
    expected = generate(model, prompt, 64, 0.8, 0.9, 5, {tokenizer.eos_token_id})
    assert answer["output_ids"] == expected.output_ids
    logprobs = [entry[0] for entry in answer["meta_info"]["output_token_logprobs"]]
    assert logprobs == pytest.approx(expected.logprobs, abs=1e-6)
    assert logprobs == pytest.approx(score(model, prompt, answer["output_ids"], 0.8), abs=1e-5)
    # SamplingParams has no field `seed`: SGLang refuses it (the router would drop it first).
    body["sampling_params"] = {**params, "seed": 5}
    refused = await _post(f"{sglang_emulator_url}/generate", body)
    assert refused.status_code == 400 and "seed" in refused.json()["error"]["message"]


async def test_generate_length_and_stop_token_ids(sglang_emulator_url, model, tokenizer):
    prompt = _chat_ids(tokenizer, MESSAGES)
    greedy = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    answer = (await _post(f"{sglang_emulator_url}/generate", greedy)).json()
    assert answer["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert len(answer["output_ids"]) == 3
    stop_at = answer["output_ids"][1]
    greedy["sampling_params"] = {"max_new_tokens": 50, "temperature": 0, "stop_token_ids": [stop_at]}
    stopped = (await _post(f"{sglang_emulator_url}/generate", greedy)).json()
    assert stopped["output_ids"][-1] == stop_at
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}


def _sse_events(raw: str) -> list[str]:
    events = [block for block in raw.split("\n\n") if block]
    assert all(event.startswith("data: ") for event in events), events[:3]
    return [event[len("data: ") :] for event in events]


async def test_generate_streams_cumulative_chunks(sglang_emulator_url, tokenizer):
    body = {
        "input_ids": _chat_ids(tokenizer, MESSAGES),
        "sampling_params": {"max_new_tokens": 40, "temperature": 0.9, "sampling_seed": 2},
        "return_logprob": True,
    }
    whole = (await _post(f"{sglang_emulator_url}/generate", body)).json()
    response = await _post(f"{sglang_emulator_url}/generate", {**body, "stream": True})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = _sse_events(response.text)
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(event) for event in events[:-1]]
    assert len(chunks) == len(whole["output_ids"])
    for count, chunk in enumerate(chunks, start=1):
        assert chunk["output_ids"] == whole["output_ids"][:count]
        assert len(chunk["meta_info"]["output_token_logprobs"]) == count
        assert (chunk["meta_info"]["finish_reason"] is None) == (count < len(chunks))
    last = chunks[-1]
    assert last["text"] == whole["text"]
    assert last["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]
    assert last["meta_info"]["output_token_logprobs"] == whole["meta_info"]["output_token_logprobs"]


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"[1, 2]",
        b"{}",
        b'{"text": "hi", "input_ids": [1]}',
        b'{"input_ids": [[1, 2], [3]]}',
        b'{"input_ids": []}',
        b'{"input_ids": [1000000]}',
        b'{"input_ids": [-1]}',
        b'{"input_ids": [1.5]}',
        b'{"text": ["batched", "texts"]}',
        b'{"input_ids": [1], "sampling_params": [1]}',
        b'{"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}',
        b'{"input_ids": [1], "sampling_params": {"temperature": -0.5}}',
        b'{"input_ids": [1], "sampling_params": {"top_p": 0}}',
        b'{"input_ids": [1], "sampling_params": {"top_p": 1.5}}',
        b'{"input_ids": [1], "sampling_params": {"stop_token_ids": "x"}}',
        b'{"input_ids": [1], "sampling_params": {"sampling_seed": "x"}}',
        b'{"input_ids": [1], "return_logprob": "yes"}',
    ],
)
async def test_generate_rejects_bad_input(sglang_emulator_url, body):
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.post(
            f"{sglang_emulator_url}/generate", content=body, headers={"content-type": "application/json"}
        )
    assert response.status_code == 400
    assert isinstance(response.json()["error"]["message"], str)


async def test_info_endpoints(sglang_emulator_url, test_tokenizer_dir):
    async with httpx.AsyncClient(base_url=sglang_emulator_url, timeout=30) as client:
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/health_generate")).status_code == 200
        model_info = (await client.get("/model_info")).json()
        assert model_info == (await client.get("/get_model_info")).json()
        assert model_info["is_generation"] is True
        assert model_info["tokenizer_path"] == str(test_tokenizer_dir)
        # The router loads its tokenizer from model_path: it must be the local directory.
        assert model_info["model_path"] == str(test_tokenizer_dir)
        server_info = (await client.get("/server_info")).json()
        assert server_info == (await client.get("/get_server_info")).json()
        assert server_info["port"] == httpx.URL(sglang_emulator_url).port
        assert server_info["model_path"] == model_info["model_path"]
        assert isinstance(server_info["version"], str) and server_info["version"]
        models = (await client.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == [engine_server.DEFAULT_MODEL_NAME]


async def test_chat_completions_with_the_openai_client(sglang_emulator_url, model, tokenizer):
    import openai

    client = openai.AsyncOpenAI(base_url=f"{sglang_emulator_url}/v1", api_key="unused", max_retries=0)
    completion = await client.chat.completions.create(
        model=engine_server.DEFAULT_MODEL_NAME, messages=MESSAGES, temperature=0, max_tokens=64, logprobs=True
    )
    prompt = _chat_ids(tokenizer, MESSAGES)
    expected = generate(model, prompt, 64, 0.0, 1.0, None, {tokenizer.eos_token_id})
    choice = completion.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == tokenizer.decode(expected.output_ids, skip_special_tokens=True)
    assert choice.finish_reason == expected.finish
    assert [c.logprob for c in choice.logprobs.content] == pytest.approx(expected.logprobs, abs=1e-6)
    assert completion.usage.prompt_tokens == len(prompt)
    assert completion.usage.completion_tokens == len(expected.output_ids)
    with pytest.raises(openai.BadRequestError, match="stream"):
        await client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
    await client.close()


async def test_delay_keeps_the_event_loop_responsive(test_tokenizer_dir, tokenizer):
    delay = 0.5
    app = engine_server.create_app(str(test_tokenizer_dir), seed=0, delay_s=delay)
    body = {"input_ids": tokenizer.encode("Hello"), "sampling_params": {"max_new_tokens": 8}}
    with serve_app(app) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            started = time.perf_counter()
            slow = [asyncio.create_task(client.post("/generate", json=body)) for _ in range(2)]
            await asyncio.sleep(0.1)
            health_started = time.perf_counter()
            assert (await client.get("/health")).status_code == 200
            assert time.perf_counter() - health_started < 0.2
            assert not any(task.done() for task in slow)
            responses = await asyncio.gather(*slow)
            elapsed = time.perf_counter() - started
    assert all(r.status_code == 200 for r in responses)
    # Both waited the delay, and the delays overlapped.
    assert delay <= elapsed < 2 * delay


# --- the real sglang-router in front of the engine ---------------------------------------------


async def _post_when_routed(url: str, body: dict, patience_s: float = 30.0) -> httpx.Response:
    """POST through the router, retrying while it has no registered worker yet (it answers
    /health before the worker registration finishes in the background)."""
    deadline = time.monotonic() + patience_s
    async with httpx.AsyncClient(timeout=30) as client:
        while True:
            response = await client.post(url, json=body)
            if response.status_code == 200 or time.monotonic() >= deadline:
                return response
            await asyncio.sleep(0.1)


@pytest.mark.router
async def test_sglang_router_routes_generate_to_the_engine(test_tokenizer_dir, model, tokenizer):
    engine_port, router_port, metrics_port = free_port(), free_port(), free_port()
    engine_url, router_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{router_port}"
    engine_cli = shutil.which("rolloutfleet-sglang-emulator")
    assert engine_cli, "the rolloutfleet-sglang-emulator console script is not installed"
    engine_argv = [engine_cli, "--host", "127.0.0.1", "--port", str(engine_port)]
    engine_argv += ["--tokenizer-path", str(test_tokenizer_dir), "--seed", "0", "--log-level", "warning"]
    engine_argv += ["--enable-deterministic-inference"]
    router_argv = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1"]
    router_argv += ["--port", str(router_port), "--worker-urls", engine_url, "--policy", "round_robin"]
    router_argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
    router_argv += ["--log-level", "warn"]
    prompt = _chat_ids(tokenizer, MESSAGES)
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 64, "temperature": 0.8, "top_p": 0.95, "sampling_seed": 9},
        "return_logprob": True,
        "logprob_start_len": -1,
    }
    with ServerProcess(engine_argv) as engine, ServerProcess(router_argv) as router:
        engine.wait_ready(f"{engine_url}/health", 60)
        router.wait_ready(f"{router_url}/health", 60)
        response = await _post_when_routed(f"{router_url}/generate", body)
        assert response.status_code == 200, response.text
        greedy_body = {**body, "sampling_params": {"max_new_tokens": 64, "temperature": 0}}
        greedy = (await _post_when_routed(f"{router_url}/generate", greedy_body)).json()
    answer = response.json()
    expected = generate(model, prompt, 64, 0.8, 0.95, 9, {tokenizer.eos_token_id})
    assert answer["output_ids"] == expected.output_ids
    logprobs = [entry[0] for entry in answer["meta_info"]["output_token_logprobs"]]
    assert logprobs == pytest.approx(expected.logprobs, abs=1e-6)
    assert answer["meta_info"]["finish_reason"]["type"] == expected.finish
    assert (
        greedy["output_ids"]
        == generate(model, prompt, 64, 0.0, 1.0, None, {tokenizer.eos_token_id}).output_ids
    )


# --- upstream stub -----------------------------------------------------------------------------


async def test_stub_answers_after_its_latency():
    latency = 0.2
    with serve_app(create_stub(latency_s=latency, output_tokens=5, token_id=7)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            started = time.perf_counter()
            full = await client.post("/generate", json={"input_ids": [1, 2, 3], "return_logprob": True})
            elapsed = time.perf_counter() - started
            capped = await client.post(
                "/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 3}}
            )
            stats = (await client.get("/stats")).json()
    assert latency <= elapsed < latency + 0.5
    answer = full.json()
    assert answer["output_ids"] == [7] * 5
    assert answer["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert answer["meta_info"]["prompt_tokens"] == 3
    assert answer["meta_info"]["completion_tokens"] == 5
    assert answer["meta_info"]["output_token_logprobs"] == [[TOKEN_LOGPROB, 7, None]] * 5
    assert capped.json()["output_ids"] == [7] * 3
    assert "output_token_logprobs" not in capped.json()["meta_info"]
    assert stats == {"requests": 2}


async def test_stub_serves_concurrent_requests_in_one_latency():
    latency, count = 0.3, 20
    with serve_app(create_stub(latency_s=latency, output_tokens=4)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            started = time.perf_counter()
            responses = await asyncio.gather(
                *(client.post("/generate", json={"input_ids": [i]}) for i in range(count))
            )
            elapsed = time.perf_counter() - started
            stats = (await client.get("/stats")).json()
    assert all(r.status_code == 200 and r.json()["output_ids"] == [42] * 4 for r in responses)
    assert latency <= elapsed < 3 * latency
    assert stats == {"requests": count}


async def test_stub_other_endpoints_and_errors():
    with serve_app(create_stub(latency_s=0, output_tokens=1)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            assert (await client.get("/health")).status_code == 200
            info = (await client.get("/model_info")).json()
            # No model_path: sglang-router would try to fetch a tokenizer for one.
            assert "model_path" not in info and info["is_generation"] is True
            assert (await client.get("/server_info")).json()["port"] == httpx.URL(url).port
            assert (await client.post("/generate", content=b"{oops")).status_code == 400
            assert (await client.post("/generate", json=[1])).status_code == 400
            assert (await client.get("/generate")).status_code == 405
            assert (await client.get("/nowhere")).status_code == 404
            assert (await client.get("/stats")).json() == {"requests": 0}


def test_stub_cli_serves_with_uvloop():
    cli = shutil.which("rolloutfleet-upstream-stub")
    assert cli, "the rolloutfleet-upstream-stub console script is not installed"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [cli, "--host", "127.0.0.1", "--port", str(port), "--latency-s", "0.05", "--output-tokens", "3"]
    with ServerProcess(argv) as stub:
        stub.wait_ready(f"{url}/health", 30)
        answer = httpx.post(f"{url}/generate", json={"input_ids": [1]}, timeout=10).json()
        assert answer["output_ids"] == [42] * 3
        assert wait_http_ok(f"{url}/stats").json() == {"requests": 1}


def test_the_cache_lock_excludes_a_second_holder_until_released(tmp_path, monkeypatch):
    import fcntl

    from rolloutfleet_testkit.cache import exclusive

    monkeypatch.setenv("ROLLOUTFLEET_CACHE", str(tmp_path))
    # What a second `prepare` meets while the first holds the lock: it waits.
    with exclusive("prepare"), open(tmp_path / "prepare.lock") as other, pytest.raises(BlockingIOError):
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(tmp_path / "prepare.lock") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released: taken at once
