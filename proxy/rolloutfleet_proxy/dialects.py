"""The API dialects a session speaks, behind one interface.

A dialect turns its request into the proxy's one internal turn, a `ChatRequest` (canonical chat
messages with reasoning, tool calls and tool results; tools; sampling), and the recorded result back
into its own response or streaming events. Every dialect's turns go through the same `TurnService`,
so they land in the same session tree: a history sent in one dialect matches (and branches from) the
same history recorded in another, because both become the same canonical messages. The answer is
rendered only after the turn was recorded, so a stream is the recorded reply, event by event.

| dialect | route under a session's base URL | module |
|---|---|---|
| OpenAI chat completions | `/chat/completions` | `chat_dialect` |
| Anthropic Messages | `/v1/messages` | `anthropic_messages` |
| OpenAI Responses | `/responses` | `openai_responses` |
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from .chat_tokens import TurnTokenizer
from .openai_format import ChatRequest, parse_chat_request
from .turns import TurnResult


@dataclass(frozen=True)
class RequestContext:
    """What parsing a turn request needs besides its body: the proxy's defaults and the request's own."""

    session_id: str
    default_max_tokens: int
    template_kwargs: dict[str, Any]
    tool_parser: str | None
    max_samples: int
    idempotency_key: str | None  # the Idempotency-Key header

    def one_sample_turn(self, chat: dict[str, Any], previous: int | None = None) -> ChatRequest:
        """The chat request a dialect's body is equivalent to, validated as a chat turn (its `stream`
        included); one sample, as the Messages and Responses APIs have no `n`."""
        return parse_chat_request(
            chat,
            self.default_max_tokens,
            self.template_kwargs,
            self.tool_parser,
            1,
            self.idempotency_key,
            previous,
        )


@dataclass(frozen=True)
class ParsedTurn:
    """A dialect's request as the internal turn, and what its answer repeats from the request."""

    request: ChatRequest
    echo: Any = None


@dataclass(frozen=True)
class Answered:
    """A recorded turn, with what every dialect renders its answer from."""

    session_id: str
    model: str
    created: int
    result: TurnResult
    parsed: ParsedTurn
    tokenizer: TurnTokenizer  # token strings for logprobs


class Dialect(Protocol):
    paths: tuple[str, ...]  # under a session's base URL (and its capability URL); the first is its name

    def parse(self, body: Any, context: RequestContext) -> ParsedTurn:
        """The internal turn of a request body; a `ProxyError` (400) for anything malformed."""
        ...

    def answer(self, answered: Answered) -> bytes | Iterator[bytes]:
        """The JSON body, or, when the request streams, its server-sent events."""
        ...


def sse_event(name: str, data: dict[str, Any]) -> bytes:
    """One server-sent event with a name (Anthropic's and Responses' streams name every event)."""
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"
