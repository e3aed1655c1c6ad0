"""OpenAI chat-completions requests in, responses (JSON or SSE) out."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from rolloutfleet_wire.errors import ErrorCode

from .chat_tools import ToolSpec, check_tool_results, parse_tools, template_kwargs
from .errors import bad_request, not_a_json_object
from .history import InvalidMessage, UnsupportedContent, canonical_message
from .replies import Reply
from .tool_grammar import CONSTRAINABLE_PARSERS


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, Any]]  # canonical form
    sampling_params: dict[str, Any]
    stream: bool
    include_usage: bool
    logprobs: bool
    tools: ToolSpec | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    n: int = 1  # samples of the same prompt (a GRPO group): each is recorded as its own branch
    regenerate: bool = False  # a new sample even if this exact request was answered before
    idempotency_key: str | None = None  # the Idempotency-Key header
    # The recorded turn whose reply `messages` follow (Responses' previous_response_id): the history is
    # that turn's, then `messages`; None: `messages` are the whole conversation.
    previous: int | None = None


def _number(body: dict[str, Any], name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad_request(ErrorCode.INVALID_PARAMETER, f"{name} must be a number")
    if not low <= value <= high:
        raise bad_request(ErrorCode.INVALID_PARAMETER, f"{name} must be between {low} and {high}")
    return float(value)


def _positive_int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise bad_request(ErrorCode.INVALID_PARAMETER, f"{name} must be a positive integer")
    return value


MAX_IDEMPOTENCY_KEY_CHARS = 255


def parse_idempotency_key(value: str | None) -> str | None:
    if value is None:
        return None
    if not value or len(value) > MAX_IDEMPOTENCY_KEY_CHARS:
        raise bad_request(
            ErrorCode.INVALID_PARAMETER,
            f"the Idempotency-Key header must be 1 to {MAX_IDEMPOTENCY_KEY_CHARS} characters",
        )
    return value


def parse_chat_request(
    body: Any,
    default_max_tokens: int,
    default_template_kwargs: dict[str, Any] | None = None,
    tool_parser: str | None = None,
    max_n: int = 1,
    idempotency_key: str | None = None,
    previous: int | None = None,
) -> ChatRequest:
    """Validate an OpenAI chat request; unknown OpenAI parameters are ignored, wrong ones are 400.
    Tools need a tool-call parser (`tool_parser`, SGLang's name), or their calls could not be returned.
    `previous`: the messages follow that recorded turn's reply (tool results that open them answer its
    calls, which the turn checks)."""
    if not isinstance(body, dict):
        raise not_a_json_object()
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request(ErrorCode.INVALID_MESSAGES, "messages must be a non-empty list")
    try:
        canonical = [canonical_message(m) for m in messages]
    except UnsupportedContent as exc:
        raise bad_request(ErrorCode.UNSUPPORTED_CONTENT, str(exc)) from None
    except InvalidMessage as exc:
        raise bad_request(ErrorCode.INVALID_MESSAGES, str(exc)) from None
    check_tool_results(canonical, after_recorded_reply=previous is not None)
    tools = parse_tools(body)
    if tools is not None and tool_parser is None:
        raise bad_request(
            ErrorCode.UNSUPPORTED_PARAMETER,
            "this proxy has no tool-call parser, so tool calls could not be returned: set "
            "spec.proxy.toolCallParser on the fleet (ROLLOUTFLEET_PROXY_TOOL_CALL_PARSER)",
        )
    if tools is not None and tools.forces_call and tool_parser not in CONSTRAINABLE_PARSERS:
        raise bad_request(
            ErrorCode.UNSUPPORTED_PARAMETER,
            f"tool_choice {tools.choice!r} cannot be enforced with the tool-call parser {tool_parser!r}: "
            "the proxy has no grammar for its format",
        )
    n = body.get("n")
    if n is None:
        n = 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= max_n:
        raise bad_request(
            ErrorCode.INVALID_PARAMETER, f"n must be an integer from 1 to {max_n} (max_samples)"
        )
    regenerate = body.get("regenerate", False)
    if not isinstance(regenerate, bool):
        raise bad_request(ErrorCode.INVALID_PARAMETER, "regenerate must be a boolean")
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
    for name in ("top_k", "min_p", "repetition_penalty"):  # SGLang sampling parameters passed through
        value = body.get(name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise bad_request(ErrorCode.INVALID_PARAMETER, f"{name} must be a number")
            sampling[name] = value
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise bad_request(ErrorCode.INVALID_PARAMETER, "stop must be a string or a list of strings")
        sampling["stop"] = stop
    seed = body.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise bad_request(ErrorCode.INVALID_PARAMETER, "seed must be an integer")
        sampling["sampling_seed"] = seed
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request(ErrorCode.INVALID_PARAMETER, "stream must be a boolean")
    options = body.get("stream_options") or {}
    return ChatRequest(
        messages=canonical,
        sampling_params=sampling,
        stream=stream,
        include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
        logprobs=bool(body.get("logprobs", False)),
        tools=tools,
        template_kwargs=template_kwargs(body, default_template_kwargs or {}),
        n=n,
        regenerate=regenerate,
        idempotency_key=parse_idempotency_key(idempotency_key),
        previous=previous,
    )


def finish_reason(sglang_finish: str, reply: Reply) -> str:
    if reply.tool_calls:
        return "tool_calls"
    return "length" if sglang_finish == "length" else "stop"


def logprobs_content(tokens: list[str], logprobs: list[float]) -> dict[str, Any]:
    return {
        "content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(tokens, logprobs, strict=True)
        ]
    }


@dataclass(frozen=True)
class CompletionChoice:
    reply: Reply
    finish: str  # SGLang's finish type
    logprobs: dict[str, Any] | None


@dataclass(frozen=True)
class Completion:
    """A recorded answer, ready to be rendered as a chat.completion or as its chunk stream."""

    completion_id: str
    model: str
    created: int
    choices: list[CompletionChoice]
    prompt_tokens: int
    completion_tokens: int
    extra: dict[str, Any]

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


def completion_body(c: Completion) -> bytes:
    choices = [
        {
            "index": index,
            "message": choice.reply.message(),
            "finish_reason": finish_reason(choice.finish, choice.reply),
            "logprobs": choice.logprobs,
        }
        for index, choice in enumerate(c.choices)
    ]
    return orjson.dumps(
        {
            "id": c.completion_id,
            "object": "chat.completion",
            "created": c.created,
            "model": c.model,
            "choices": choices,
            "usage": c.usage(),
            "rolloutfleet": c.extra,
        }
    )


def completion_sse(c: Completion, include_usage: bool) -> Iterator[bytes]:
    """The recorded answer as a chat.completion.chunk stream (sent only after it was recorded); with
    several choices, each choice's chunks in turn, told apart by their index."""

    def chunk(choices: list[dict[str, Any]], **more: Any) -> bytes:
        body = {
            "id": c.completion_id,
            "object": "chat.completion.chunk",
            "created": c.created,
            "model": c.model,
            "choices": choices,
            **more,
        }
        return b"data: " + orjson.dumps(body) + b"\n\n"

    for index, answer in enumerate(c.choices):

        def choice(
            delta: dict[str, Any], reason: str | None, logprobs: Any = None, index: int = index
        ) -> list[dict[str, Any]]:
            return [{"index": index, "delta": delta, "finish_reason": reason, "logprobs": logprobs}]

        reply = answer.reply
        yield chunk(choice({"role": "assistant", "content": ""}, None))
        if reply.reasoning is not None:
            yield chunk(choice({"reasoning_content": reply.reasoning}, None))
        if reply.content or not reply.tool_calls:
            yield chunk(choice({"content": reply.content}, None, answer.logprobs))
        for call_index, call in enumerate(reply.tool_calls):
            delta_call = {"index": call_index, **call}
            logprobs = answer.logprobs if call_index == 0 and not reply.content else None
            yield chunk(choice({"tool_calls": [delta_call]}, None, logprobs))
        last = index == len(c.choices) - 1
        final = {"rolloutfleet": c.extra} if last else {}
        yield chunk(choice({}, finish_reason(answer.finish, reply)), **final)
    if include_usage:
        yield chunk([], usage=c.usage())
    yield b"data: [DONE]\n\n"


def json_body(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(ErrorCode.INVALID_JSON, f"request body is not valid JSON: {exc}") from None
