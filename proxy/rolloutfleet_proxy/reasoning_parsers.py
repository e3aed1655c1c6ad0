"""The reasoning part of a model's reply split from its content, one parser per SGLang `--reasoning-parser`.

Mirrors the non-streaming `detect_and_parse` of SGLang's detectors (python/sglang/srt/parser/
reasoning_parser.py) for the think-tag families:
- A reply is in reasoning mode when the parser is forced (SGLang constructs deepseek-r1 and qwen3-thinking
  with force_reasoning=True: their templates open the think block in the prompt), when the caller says
  the prompt ended inside an open think block, or when the reply begins with the start tag. (SGLang also
  enters reasoning mode on a start tag later in the text; a tag mid-reply is left as content here.)
- In reasoning mode, leading start tags are dropped, the reasoning runs to the first end tag and the
  content is what follows. With no end tag the reply was cut off and is all reasoning, except that for
  qwen3 and glm45 a `<tool_call>` ends the reasoning (newer SGLang: the model opened a call without
  closing its thought).
- Whitespace: SGLang 0.5.4 strips the text after the start tag and the content; the reasoning's trailing
  whitespace it strips only when streaming. Both parts are stripped here, so the two paths agree. Empty
  reasoning is None, as SGLang's chat response reports it. A reply not in reasoning mode is returned
  unchanged as content.

And `gpt-oss` (SGLang's GptOssDetector over its HarmonyParser), which has channels instead of tags: the
analysis channel's bodies are the reasoning; final and preamble (commentary) bodies are the content,
and a message addressed to a tool stays in the content as written, for the `gpt-oss` tool-call parser.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .harmony_text import harmony_messages, is_harmony


@dataclass(frozen=True)
class SplitReply:
    reasoning: str | None  # None when the reply had no reasoning part
    content: str


class ReasoningSplitter(Protocol):
    @property
    def name(self) -> str: ...

    def split(self, text: str, prompt_opened_reasoning: bool = False) -> SplitReply: ...


@dataclass(frozen=True)
class ReasoningParser:
    """A think-tag format: reasoning between a start and an end tag at the start of the reply."""

    name: str
    start_tag: str
    end_tag: str
    forced: bool = False  # the reply always starts inside reasoning (SGLang's force_reasoning=True)
    tool_start: str | None = None  # a tool-call tag that ends unclosed reasoning

    def split(self, text: str, prompt_opened_reasoning: bool = False) -> SplitReply:
        body = text.lstrip()
        opens_with_tag = body.startswith(self.start_tag)
        if not (self.forced or prompt_opened_reasoning or opens_with_tag):
            return SplitReply(None, text)
        while body.startswith(self.start_tag):
            body = body[len(self.start_tag) :]
        end = body.find(self.end_tag)
        if end != -1:
            reasoning, content = body[:end], body[end + len(self.end_tag) :]
        else:
            tool = body.find(self.tool_start) if self.tool_start else -1
            reasoning, content = (body[:tool], body[tool:]) if tool != -1 else (body, "")
        return SplitReply(reasoning.strip() or None, content.strip())


@dataclass(frozen=True)
class HarmonyReasoningParser:
    """gpt-oss: the analysis channel is the reasoning, the final channel the content (harmony_text.py)."""

    name: str = "gpt-oss"

    def split(self, text: str, prompt_opened_reasoning: bool = False) -> SplitReply:
        if not is_harmony(text):
            return SplitReply(None, text)
        messages, _ = harmony_messages(text)
        reasoning: list[str] = []
        content: list[str] = []
        cursor = 0
        for message in messages:
            content.append(text[cursor : message.start])  # text outside messages stays content
            if message.recipient is not None:
                content.append(text[message.start : message.end])  # a call, as written
            elif message.channel == "analysis":
                reasoning.append(message.body or "")
            elif message.body is not None:
                content.append(message.body)
            cursor = message.end
        content.append(text[cursor:])
        return SplitReply(
            "".join(reasoning).strip() or None, " ".join(part for part in content if part.strip()).strip()
        )


_THINK, _END_THINK = "<think>", "</think>"

_PARSERS: dict[str, ReasoningSplitter] = {
    parser.name: parser
    for parser in (
        ReasoningParser("qwen3", _THINK, _END_THINK, tool_start="<tool_call>"),
        ReasoningParser("qwen3-thinking", _THINK, _END_THINK, forced=True, tool_start="<tool_call>"),
        ReasoningParser("deepseek-r1", _THINK, _END_THINK, forced=True),
        ReasoningParser("glm45", _THINK, _END_THINK, tool_start="<tool_call>"),
        # Kimi's thinking models (Kimi-VL-Thinking, k1.5) use their own tags.
        ReasoningParser("kimi", "◁think▷", "◁/think▷"),
        HarmonyReasoningParser(),
    )
}

REASONING_PARSER_NAMES: frozenset[str] = frozenset(_PARSERS)


def reasoning_parser(name: str) -> ReasoningSplitter:
    """The parser SGLang's `--reasoning-parser NAME` selects; ValueError naming the known ones otherwise."""
    parser = _PARSERS.get(name)
    if parser is None:
        known = ", ".join(sorted(REASONING_PARSER_NAMES))
        raise ValueError(f"unknown reasoning parser {name!r}; known parsers: {known}")
    return parser
