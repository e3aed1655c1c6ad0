"""How the proxy treats what SGLang answers: its 400s are the client's errors (not retryable 502s,
the session unchanged), and every /generate carries the session as sglang-router's routing key.

The upstream here is a few lines of ASGI answering as SGLang's `_create_error_response` does
(`{"error": {"message": ...}}`, HTTP 400) with the messages of `TokenizerManager._validate_one_request`
and `SamplingParams.verify`; it records each request's headers.

GRPO groups: `SGLangClient.generate_samples` asks for n samples of a prompt in one `/generate`
(`sampling_params.n`), against the SGLang emulator (a test stand-in, its parallel sampling written from
`TokenizerManager._handle_batch_request`) straight and behind the real sglang-router 0.3.2, which passes
`n` through."""

from __future__ import annotations

import asyncio
import time
from array import array

import httpx
import pytest
from proxy_harness import running_proxy
from rolloutfleet_proxy.errors import http_error
from rolloutfleet_proxy.failures import UpstreamFailed
from rolloutfleet_proxy.upstream import (
    ROUTING_KEY_HEADER,
    SGLangClient,
    refused_request,
    sglang_error_message,
)
from rolloutfleet_testkit.asgi import lifespan, read_body, send_json
from rolloutfleet_testkit.processes import serve_app
from rolloutfleet_testkit.routed_engines import routed_emulators
from rolloutfleet_testkit.sglang_emulator.model import load_model, score
from rolloutfleet_testkit.sglang_emulator.server import create_app


@pytest.fixture(scope="module")
def tokenizer(test_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(test_tokenizer_dir))


CONTEXT = "The input (40000 tokens) is longer than the model's context length (32768 tokens)."
TOTAL = (
    "Requested token count exceeds the model's maximum context length of 32768 tokens. You requested "
    "a total of 33000 tokens: 32000 tokens from the input messages and 1000 tokens for the completion."
)
TOP_K = "top_k must be -1 (disable), or at least 1, got 0."


class RefusingUpstream:
    def __init__(self, message: str):
        self.message = message
        self.headers: list[dict[str, str]] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        await read_body(receive)
        self.headers.append({k.decode().lower(): v.decode() for k, v in scope["headers"]})
        await send_json(send, 400, {"error": {"message": self.message}})


@pytest.mark.parametrize(
    ("message", "code"),
    [
        (CONTEXT, "context_length_exceeded"),
        (TOTAL, "context_length_exceeded"),
        (TOP_K, "invalid_sampling_params"),
    ],
)
def test_sglang_400s_are_the_clients_errors(message, code):
    error = http_error(
        refused_request(sglang_error_message(b'{"error": {"message": "' + message.encode() + b'"}}'))
    )
    assert (error.status, error.code) == (400, code)
    assert message in error.message


def test_error_message_shapes():
    assert sglang_error_message(b'{"message": "old shape"}') == "old shape"
    assert sglang_error_message(b"not json") == "not json"
    assert sglang_error_message(b'{"error": "x"}') == '{"error": "x"}'


@pytest.mark.parametrize(
    ("message", "code"), [(CONTEXT, "context_length_exceeded"), (TOP_K, "invalid_sampling_params")]
)
def test_a_refused_turn_is_400_with_the_session_unchanged_and_routed_by_session(
    message, code, test_tokenizer_dir, tmp_path
):
    upstream = RefusingUpstream(message)
    with serve_app(upstream) as url, running_proxy(url, test_tokenizer_dir, tmp_path / "d") as proxy:
        sid, key = proxy.create_session()
        before = proxy.get(sid, key).json()
        response = httpx.post(
            f"{proxy.url}/v1/sessions/{sid}/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"messages": [{"role": "user", "content": "long story"}]},
        )
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == code and message in error["message"]
        assert proxy.get(sid, key).json() == before
        assert upstream.headers[-1][ROUTING_KEY_HEADER.lower()] == sid


def test_length_with_eos_as_the_last_token_is_a_stop(test_tokenizer_dir, tmp_path):
    """`Req.check_finished` tests max_new_tokens before EOS: when EOS is the last allowed token SGLang
    says `length` with no `matched`. The reply is still closed by its EOS: the next turn must not add
    a second `<|im_end|>`."""
    from rolloutfleet_testkit.scripted_upstream import ScriptedUpstream
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(test_tokenizer_dir))
    upstream = ScriptedUpstream(lambda ids: tokenizer.decode(ids, skip_special_tokens=True), stop_ids=())
    reply = tokenizer.encode("Hello there<|im_end|>", add_special_tokens=False)
    upstream.script(reply, reply)
    with serve_app(upstream) as url, running_proxy(url, test_tokenizer_dir, tmp_path / "d") as proxy:
        sid, key = proxy.create_session()
        chat = f"{proxy.url}/v1/sessions/{sid}/chat/completions"
        auth = {"Authorization": f"Bearer {key}"}
        messages = [{"role": "user", "content": "hi"}]
        first = httpx.post(chat, headers=auth, json={"messages": messages, "max_tokens": len(reply)}).json()
        assert first["choices"][0]["finish_reason"] == "length"
        messages += [first["choices"][0]["message"], {"role": "user", "content": "again"}]
        assert httpx.post(chat, headers=auth, json={"messages": messages}).status_code == 200
        ids = proxy.get(sid, key).json()["trajectory"]["input_ids"]
        expected = tokenizer.apply_chat_template(
            [*messages[:1], {"role": "assistant", "content": "Hello there"}, messages[2]],
            add_generation_prompt=True,
            tokenize=True,
        )["input_ids"]
        assert ids[: len(expected)] == expected, "one <|im_end|>, then the template's newline"


class FailingUpstream:
    """Answers every /generate with `status` (as SGLang does for a scheduler-side failure: 500 from
    an exception, 503 while it is unhealthy or shutting down), or never answers (`hang`)."""

    def __init__(self, status: int | None):
        self.status = status
        self.requests = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        await read_body(receive)
        self.requests += 1
        if self.status is None:
            await asyncio.sleep(3600)  # a hung engine; the proxy's timeout ends the wait
        await send_json(send, self.status, {"error": {"message": f"engine failure {self.status}"}})


@pytest.mark.parametrize(
    ("status", "expected", "code"),
    [(500, 502, "upstream_error"), (503, 502, "upstream_error"), (None, 504, "upstream_timeout")],
    ids=["500", "503", "hang"],
)
def test_a_failing_engine_gets_a_retryable_error_and_leaves_the_session_intact(
    status, expected, code, test_tokenizer_dir, tmp_path
):
    upstream = FailingUpstream(status)
    with (
        serve_app(upstream) as url,
        running_proxy(url, test_tokenizer_dir, tmp_path / "d", upstream_timeout_s=1.0) as proxy,
    ):
        sid, key = proxy.create_session()
        before = proxy.get(sid, key).json()
        response = httpx.post(
            f"{proxy.url}/v1/sessions/{sid}/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"messages": [{"role": "user", "content": "hello"}]},
            timeout=30,
        )
        assert (response.status_code, response.json()["error"]["code"]) == (expected, code)
        assert upstream.requests == 1
        assert proxy.get(sid, key).json() == before
        assert proxy.stats()["totals"]["turns_failed"] == 1


# --- GRPO groups: n samples in one /generate ---------------------------------------------------------


def _prompt(tokenizer) -> array:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three rivers, then stop."}],
        add_generation_prompt=True,
        tokenize=True,
    )["input_ids"]
    return array("i", ids)


def _check_group(samples, prompt: array, tokenizer, temperature: float) -> None:
    """n distinct samples, each with its own engine rid, logprobs the model's own at `temperature`
    (SGLang's tempered output_token_logprobs) and the prompt cached by the group's prefill-only request."""
    model = load_model(len(tokenizer), seed=0, eos_token_id=tokenizer.eos_token_id)
    assert len({tuple(sample.output_ids) for sample in samples}) == len(samples)
    assert len({sample.rid for sample in samples}) == len(samples)
    for sample in samples:
        expected = score(model, prompt.tolist(), sample.output_ids.tolist(), temperature)
        assert sample.logprobs.tolist() == pytest.approx(expected, abs=1e-4)
        assert sample.prompt_tokens == len(prompt) and sample.cached_tokens == len(prompt) - 1
        assert sample.finish_reason in ("stop", "length") and not sample.aborted


async def _stats(client: httpx.AsyncClient, url: str) -> dict:
    return (await client.get(f"{url}/emulator_stats")).json()


async def test_generate_samples_is_one_engine_call_for_a_group(test_tokenizer_dir, tokenizer):
    prompt = _prompt(tokenizer)
    sampling = {"max_new_tokens": 16, "temperature": 1.0}
    with serve_app(create_app(str(test_tokenizer_dir), seed=0)) as url:
        upstream = SGLangClient(url, 60, 4)
        try:
            samples = await upstream.generate_samples(prompt, sampling, 4, routing_key="s-1", rid="r-1")
            async with httpx.AsyncClient() as client:
                stats = await _stats(client, url)
            (single,) = await upstream.generate_samples(prompt, {**sampling, "temperature": 0}, 1, rid="r-2")
            greedy = await upstream.generate(prompt, {**sampling, "temperature": 0}, rid="r-3")
        finally:
            await upstream.aclose()
    assert len(samples) == 4
    # One /generate: SGLang's prefill-only request for the prompt, then the 4 samples (4 separate
    # calls would be 4 engine requests, the first with nothing cached).
    assert stats["requests"] == 1 + 4
    _check_group(samples, prompt, tokenizer, 1.0)
    assert "r-1" not in {sample.rid for sample in samples}  # SGLang names each sample anew
    # n = 1 is a plain single request: SGLang answers one object, under the request's rid.
    assert single.rid == "r-2" and single.output_ids == greedy.output_ids


async def test_a_pause_in_abort_mode_answers_every_sample_aborted_with_its_tokens(
    test_tokenizer_dir, tokenizer
):
    prompt = _prompt(tokenizer)
    with serve_app(create_app(str(test_tokenizer_dir), seed=0, token_delay_s=0.02)) as url:
        upstream = SGLangClient(url, 60, 4)
        try:
            async with httpx.AsyncClient() as client:
                group = asyncio.create_task(
                    upstream.generate_samples(prompt, {"max_new_tokens": 300, "ignore_eos": True}, 3)
                )
                deadline = time.monotonic() + 20
                while (await _stats(client, url))["running"] < 3:
                    assert time.monotonic() < deadline, "the samples never started"
                    await asyncio.sleep(0.02)
                await asyncio.sleep(0.2)
                await client.post(f"{url}/pause_generation", json={"mode": "abort"})
                samples = await group
                await client.post(f"{url}/continue_generation")
        finally:
            await upstream.aclose()
    assert len(samples) == 3
    for sample in samples:
        assert sample.aborted and 0 < len(sample.output_ids) < 300
        assert len(sample.logprobs) == len(sample.output_ids)


async def test_an_upstream_that_ignores_n_is_an_upstream_error():
    async def one_answer(scope, receive, send) -> None:  # an engine that answers a single result
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        await read_body(receive)
        result = {"output_ids": [5], "meta_info": {"finish_reason": {"type": "length", "length": 1}}}
        result["meta_info"]["output_token_logprobs"] = [[-0.5, 5, None]]
        await send_json(send, 200, result)

    with serve_app(one_answer) as url:
        upstream = SGLangClient(url, 10, 2)
        try:
            with pytest.raises(UpstreamFailed) as error:
                await upstream.generate_samples([1, 2, 3], {"max_new_tokens": 1}, 3)
            assert http_error(error.value).status == 502 and "1 results for n=3" in error.value.message
            assert len(await upstream.generate_samples([1, 2, 3], {"max_new_tokens": 1}, 1)) == 1
            with pytest.raises(ValueError):
                await upstream.generate_samples([1, 2, 3], {"max_new_tokens": 1}, 0)
        finally:
            await upstream.aclose()


@pytest.mark.router
async def test_generate_samples_through_the_real_router(test_tokenizer_dir, tokenizer, tmp_path):
    """sglang-router 0.3.2 re-serializes /generate through its typed GenerateRequest, whose
    SamplingParams has `n: Option<u32>`: n reaches the engine, and the engine's list comes back as is.
    The routing key keeps the whole group on one engine."""
    prompt = _prompt(tokenizer)
    with routed_emulators(test_tokenizer_dir, tmp_path, count=2, policy="manual") as (router_url, engines):
        async with httpx.AsyncClient() as client:
            before = [(await _stats(client, url))["cached_tokens"] for url in engines]
            upstream = SGLangClient(router_url, 60, 4)
            try:
                samples = await upstream.generate_samples(
                    prompt, {"max_new_tokens": 12, "temperature": 1.0}, 3, routing_key="session-7"
                )
            finally:
                await upstream.aclose()
            after = [(await _stats(client, url))["cached_tokens"] for url in engines]
    assert len(samples) == 3
    _check_group(samples, prompt, tokenizer, 1.0)
    # The whole group ran on one engine: each sample found the prompt cached (all but its last token,
    # SGLang's cap), and the group's prefill-only request may have found the start of it cached by an
    # earlier health probe of the router there (which depends on timing). The router's one-token
    # health probes never report cached tokens themselves, so the other engine gained none.
    idle, busy = sorted(a - b for a, b in zip(after, before, strict=True))
    assert idle == 0 and 3 * (len(prompt) - 1) <= busy <= 4 * (len(prompt) - 1)
