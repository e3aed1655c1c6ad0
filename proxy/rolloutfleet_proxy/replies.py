"""From the ids a model generated to the OpenAI assistant message: reasoning, content, tool calls.

The recorded ids are the model's own, whatever is parsed out of them: parsing only shapes what the
client is told (and the history it must send back). Parsing works on the reply decoded with its
special tokens (SGLang decodes without them by default, which would erase harmony's and GLM's
markup), minus the token that stopped it and minus a matched stop string (SGLang trims it from the
text; its tokens stay recorded); special tokens the parsers leave over are then removed, as SGLang's
decoding would. A malformed tool call stays plain content: never an error.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .chat_tokens import TurnTokenizer
from .chat_tools import ToolSpec
from .upstream import Generation

if TYPE_CHECKING:
    from .reasoning_parsers import ReasoningParser
    from .tool_parsers import ToolCallParser

# Start and end tags of reasoning blocks: a generation prompt that ends inside one (DeepSeek-R1's
# "<think>\n") makes the reply begin in reasoning without the tag.
_REASONING_TAGS = (("<think>", "</think>"), ("◁think▷", "◁/think▷"))


def prompt_opens_reasoning(prompt_tail: str) -> bool:
    for start, end in _REASONING_TAGS:
        opened = prompt_tail.rfind(start)
        if opened >= 0 and opened > prompt_tail.rfind(end):
            return True
    return False


@dataclass(frozen=True)
class Reply:
    content: str
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI form, arguments as JSON text

    def message(self) -> dict[str, Any]:
        """The OpenAI assistant message."""
        message: dict[str, Any] = {
            "role": "assistant",
            "content": self.content if self.content or not self.tool_calls else None,
        }
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


def _call_id() -> str:
    return "call_" + secrets.token_hex(12)


class ReplyBuilder:
    """Turns a generation into a Reply with the proxy's configured parsers (SGLang's names)."""

    def __init__(self, tokenizer: TurnTokenizer, tool_parser: str | None, reasoning: str | None):
        self._tokenizer = tokenizer
        self.tool_parser: ToolCallParser | None = None
        self.reasoning_parser: ReasoningParser | None = None
        if tool_parser:
            from .tool_parsers import tool_call_parser

            self.tool_parser = tool_call_parser(tool_parser)
        if reasoning:
            from .reasoning_parsers import reasoning_parser

            self.reasoning_parser = reasoning_parser(reasoning)

    def build(
        self, generation: Generation, stop_token: int | None, tools: ToolSpec | None, prompt_tail: str
    ) -> Reply:
        parse_calls = self.tool_parser is not None and tools is not None and tools.parse_calls
        if self.reasoning_parser is None and not parse_calls:
            return Reply(generation.text)
        ids = generation.output_ids
        if stop_token is not None and ids and ids[-1] == stop_token:
            ids = ids[:-1]
        text = self._tokenizer.decode(ids, skip_special_tokens=False)
        if generation.stop_string:
            at = text.find(generation.stop_string)
            if at >= 0:
                text = text[:at]
        reasoning = None
        if self.reasoning_parser is not None:
            split = self.reasoning_parser.split(text, prompt_opens_reasoning(prompt_tail))
            reasoning, text = split.reasoning, split.content
        clean = self._tokenizer.without_special_tokens  # what the parsers did not consume
        if reasoning is not None:
            reasoning = clean(reasoning)
        if not parse_calls:
            return Reply(clean(text), reasoning)
        assert self.tool_parser is not None and tools is not None
        parsed = self.tool_parser.parse(text, tools.names)
        calls = [
            {
                "id": call.call_id or _call_id(),
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for call in parsed.tool_calls
        ]
        return Reply(clean(parsed.content), reasoning, calls)
