"""From the ids a model generated to the OpenAI assistant message: reasoning, content, tool calls.

The recorded ids are the model's own, whatever is parsed out of them: parsing only shapes what the
client is told (and the history it must send back). Parsing works on the reply decoded with its
special tokens (SGLang decodes without them by default, which would erase harmony's and GLM's
markup), minus the token that stopped it and minus a matched stop string (SGLang trims it from the
text; its tokens stay recorded); special tokens the parsers leave over are then removed, as SGLang's
decoding would. A malformed tool call stays plain content: never an error.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .chat_tokens import TurnTokenizer
from .chat_tools import ToolSpec

if TYPE_CHECKING:
    from .reasoning_parsers import ReasoningSplitter
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


def call_id(seed: str, index: int) -> str:
    """A tool call's id, derived from its turn (`seed`), so a replayed reply carries the same ids."""
    return "call_" + hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=12).hexdigest()


class ReplyBuilder:
    """Turns a generation into a Reply with the proxy's configured parsers (SGLang's names)."""

    def __init__(self, tokenizer: TurnTokenizer, tool_parser: str | None, reasoning: str | None):
        self._tokenizer = tokenizer
        self.tool_parser: ToolCallParser | None = None
        self.reasoning_parser: ReasoningSplitter | None = None
        if tool_parser:
            from .tool_parsers import tool_call_parser

            self.tool_parser = tool_call_parser(tool_parser)
        if reasoning:
            from .reasoning_parsers import reasoning_parser

            self.reasoning_parser = reasoning_parser(reasoning)

    def build(
        self,
        output_ids: array,
        stop_token: int | None,
        stop_string: str | None,
        tools: ToolSpec | None,
        opens_reasoning: bool,
        seed: str,
    ) -> Reply:
        """The reply of recorded output ids: a function of them and the turn's recorded facts only,
        so a replay rebuilds the same reply (`seed` names the turn, for tool call ids)."""
        parse_calls = self.tool_parser is not None and tools is not None and tools.parse_calls
        ids = output_ids
        if stop_token is not None and ids and ids[-1] == stop_token:
            ids = ids[:-1]
        plain = self.reasoning_parser is None and not parse_calls
        # Without parsers the text is decoded as SGLang decodes it (special tokens skipped).
        text = self._tokenizer.decode(ids, skip_special_tokens=plain)
        if stop_string:
            at = text.find(stop_string)
            if at >= 0:
                text = text[:at]
        if plain:
            return Reply(text)
        reasoning = None
        if self.reasoning_parser is not None:
            split = self.reasoning_parser.split(text, opens_reasoning)
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
                "id": call.call_id or call_id(seed, index),
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for index, call in enumerate(parsed.tool_calls)
        ]
        return Reply(clean(parsed.content), reasoning, calls)
