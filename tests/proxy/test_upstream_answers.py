"""How the proxy treats what SGLang answers: its 400s are the client's errors (not retryable 502s,
the session unchanged), and every /generate carries the session as sglang-router's routing key.

The upstream here is a few lines of ASGI answering as SGLang's `_create_error_response` does
(`{"error": {"message": ...}}`, HTTP 400) with the messages of `TokenizerManager._validate_one_request`
and `SamplingParams.verify`; it records each request's headers."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from proxy_harness import running_proxy
from rolloutfleet_proxy.upstream import ROUTING_KEY_HEADER, refused_request, sglang_error_message
from rolloutfleet_testkit.asgi import lifespan, read_body, send_json
from rolloutfleet_testkit.processes import serve_app

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
    error = refused_request(sglang_error_message(b'{"error": {"message": "' + message.encode() + b'"}}'))
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
