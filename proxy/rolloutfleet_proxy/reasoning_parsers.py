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
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SplitReply:
    reasoning: str | None  # None when the reply had no reasoning part
    content: str


@dataclass(frozen=True)
class ReasoningParser:
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


_THINK, _END_THINK = "<think>", "</think>"

_PARSERS: dict[str, ReasoningParser] = {
    parser.name: parser
    for parser in (
        ReasoningParser("qwen3", _THINK, _END_THINK, tool_start="<tool_call>"),
        ReasoningParser("qwen3-thinking", _THINK, _END_THINK, forced=True, tool_start="<tool_call>"),
        ReasoningParser("deepseek-r1", _THINK, _END_THINK, forced=True),
        ReasoningParser("glm45", _THINK, _END_THINK, tool_start="<tool_call>"),
        # Kimi's thinking models (Kimi-VL-Thinking, k1.5) use their own tags.
        ReasoningParser("kimi", "◁think▷", "◁/think▷"),
    )
}

REASONING_PARSER_NAMES: frozenset[str] = frozenset(_PARSERS)


def reasoning_parser(name: str) -> ReasoningParser:
    """The parser SGLang's `--reasoning-parser NAME` selects; ValueError naming the known ones otherwise."""
    parser = _PARSERS.get(name)
    if parser is None:
        known = ", ".join(sorted(REASONING_PARSER_NAMES))
        raise ValueError(f"unknown reasoning parser {name!r}; known parsers: {known}")
    return parser
