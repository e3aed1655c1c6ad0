"""OpenAI chat-completions requests in, responses (JSON or SSE) out."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson

from .errors import ProxyError, bad_request
from .history import InvalidMessage, canonical_message


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, Any]]  # canonical form
    sampling_params: dict[str, Any]
    stream: bool
    include_usage: bool
    logprobs: bool


def _number(body: dict[str, Any], name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad_request("invalid_parameter", f"{name} must be a number")
    if not low <= value <= high:
        raise bad_request("invalid_parameter", f"{name} must be between {low} and {high}")
    return float(value)


def _positive_int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise bad_request("invalid_parameter", f"{name} must be a positive integer")
    return value


def parse_chat_request(body: Any, default_max_tokens: int) -> ChatRequest:
    """Validate an OpenAI chat request; unknown OpenAI parameters are ignored, wrong ones are 400."""
    if not isinstance(body, dict):
        raise bad_request("invalid_body", "the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("invalid_messages", "messages must be a non-empty list")
    try:
        canonical = [canonical_message(m) for m in messages]
    except InvalidMessage as exc:
        raise bad_request("invalid_messages", str(exc)) from None
    n = body.get("n")
    if n is not None and n != 1:
        raise bad_request("invalid_parameter", "n must be 1: a session records one trajectory")
    sampling: dict[str, Any] = {
        "max_new_tokens": _positive_int(body, "max_completion_tokens")
        or _positive_int(body, "max_tokens")
        or default_max_tokens,
    }
    for name, low, high in (
        ("temperature", 0.0, 2.0),
        ("top_p", 0.0, 1.0),
        ("presence_penalty", -2.0, 2.0),
        ("frequency_penalty", -2.0, 2.0),
    ):
        value = _number(body, name, low, high)
        if value is not None:
            sampling[name] = value
    if body.get("tools"):
        raise bad_request("unsupported_parameter", "tools are not supported: send plain chat messages")
    for name in ("top_k", "min_p", "repetition_penalty"):  # SGLang sampling parameters passed through
        value = body.get(name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise bad_request("invalid_parameter", f"{name} must be a number")
            sampling[name] = value
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise bad_request("invalid_parameter", "stop must be a string or a list of strings")
        sampling["stop"] = stop
    seed = body.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise bad_request("invalid_parameter", "seed must be an integer")
        sampling["sampling_seed"] = seed
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("invalid_parameter", "stream must be a boolean")
    options = body.get("stream_options") or {}
    return ChatRequest(
        messages=canonical,
        sampling_params=sampling,
        stream=stream,
        include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
        logprobs=bool(body.get("logprobs", False)),
    )


def finish_reason(sglang_finish: str) -> str:
    return "length" if sglang_finish == "length" else "stop"


def logprobs_content(tokens: list[str], logprobs: list[float]) -> dict[str, Any]:
    return {
        "content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(tokens, logprobs, strict=True)
        ]
    }


@dataclass(frozen=True)
class Completion:
    """A recorded reply, ready to be rendered as a chat.completion or as its chunk stream."""

    completion_id: str
    model: str
    text: str
    finish: str
    prompt_tokens: int
    completion_tokens: int
    logprobs: dict[str, Any] | None
    extra: dict[str, Any]

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


def completion_body(c: Completion) -> bytes:
    message = {"role": "assistant", "content": c.text}
    choice = {
        "index": 0,
        "message": message,
        "finish_reason": finish_reason(c.finish),
        "logprobs": c.logprobs,
    }
    return orjson.dumps(
        {
            "id": c.completion_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": c.model,
            "choices": [choice],
            "usage": c.usage(),
            "rolloutfleet": c.extra,
        }
    )


def completion_sse(c: Completion, include_usage: bool) -> Iterator[bytes]:
    """The recorded reply as a chat.completion.chunk stream (sent only after it was recorded)."""
    created = int(time.time())

    def chunk(choices: list[dict[str, Any]], **more: Any) -> bytes:
        body = {
            "id": c.completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": c.model,
            "choices": choices,
            **more,
        }
        return b"data: " + orjson.dumps(body) + b"\n\n"

    def choice(delta: dict[str, Any], reason: str | None, logprobs: Any = None) -> list[dict[str, Any]]:
        return [{"index": 0, "delta": delta, "finish_reason": reason, "logprobs": logprobs}]

    yield chunk(choice({"role": "assistant", "content": ""}, None))
    yield chunk(choice({"content": c.text}, None, c.logprobs))
    yield chunk(choice({}, finish_reason(c.finish)), rolloutfleet=c.extra)
    if include_usage:
        yield chunk([], usage=c.usage())
    yield b"data: [DONE]\n\n"


def json_body(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ProxyError(400, "invalid_json", f"request body is not valid JSON: {exc}") from None
