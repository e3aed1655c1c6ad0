"""OpenAI chat completions as a dialect: the request and answer formats of `openai_format.py`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .dialects import Answered, ParsedTurn, RequestContext
from .openai_format import (
    Completion,
    CompletionChoice,
    completion_body,
    completion_sse,
    logprobs_content,
    parse_chat_request,
)


class ChatDialect:
    paths: tuple[str, ...] = ("/chat/completions",)

    def parse(self, body: Any, context: RequestContext) -> ParsedTurn:
        return ParsedTurn(
            parse_chat_request(
                body,
                context.default_max_tokens,
                context.template_kwargs,
                context.tool_parser,
                context.max_samples,
                context.idempotency_key,
            )
        )

    def answer(self, answered: Answered) -> bytes | Iterator[bytes]:
        request, result = answered.parsed.request, answered.result
        choices = []
        for choice in result.choices:
            logprobs = None
            if request.logprobs:
                logprobs = logprobs_content(
                    answered.tokenizer.token_strings(choice.output_ids), choice.logprobs.tolist()
                )
            choices.append(CompletionChoice(choice.reply, choice.finish, logprobs))
        turns = [choice.turn for choice in result.choices]
        extra: dict[str, Any] = {"session_id": answered.session_id, "turn": result.call}
        if len(turns) > 1:
            extra["turns"] = turns
        completion = Completion(
            completion_id=f"chatcmpl-{answered.session_id}-{result.call}",
            model=answered.model,
            created=answered.created,
            choices=choices,
            prompt_tokens=result.prompt_tokens,
            completion_tokens=sum(len(choice.output_ids) for choice in result.choices),
            extra=extra,
        )
        if request.stream:
            return completion_sse(completion, request.include_usage)
        return completion_body(completion)
