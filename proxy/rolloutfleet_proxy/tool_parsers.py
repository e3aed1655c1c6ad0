"""Tool calls out of a model's reply text, one parser per SGLang `--tool-call-parser` name.

Each parser reads the text a model family writes (decoded with its special tokens kept, the final stop
token already removed) and returns the plain content plus the calls, the way SGLang's detectors in
`python/sglang/srt/function_call/` do for a non-streaming reply. They are pure functions of the text.

Rules shared by all parsers:
- Malformed calls (invalid JSON, no name, an unclosed tag, arguments that are not a JSON object) never
  raise: the whole text comes back as content with no calls, so the model's mistake stays visible.
  (SGLang logs and drops such a call instead, returning only the text before the first call.)
- A call naming a function that is not in `tool_names` is dropped and the other calls are kept, as
  SGLang does by default (SGLANG_FORWARD_UNKNOWN_TOOLS unset; base_format_detector.parse_base_json).
  When no known call remains the whole text is content, as for a malformed call, rather than SGLang's
  text-before-the-first-call, which would silently lose what the model wrote.
- Arguments are re-serialized with `json.dumps(ensure_ascii=False)` as SGLang does, except kimi_k2's,
  which SGLang passes on as the model wrote them.
- Work is linear in the text: `str.find` scans, the stdlib JSON decoder and a few regexes that cannot
  backtrack more than once over their input.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Protocol

from .harmony_text import harmony_messages, is_harmony


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    call_id: str | None = None  # an id the model wrote itself (kimi_k2), else None


@dataclass(frozen=True)
class ParsedReply:
    content: str
    tool_calls: tuple[ToolCall, ...]


class ToolCallParser(Protocol):
    @property
    def name(self) -> str: ...

    def parse(self, text: str, tool_names: Collection[str]) -> ParsedReply: ...


class _Malformed(Exception):
    """A tool call the model started but did not write correctly."""


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # NaN and Infinity would not re-serialize as valid JSON


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def _decode_json(text: str) -> Any:
    """The JSON value `text` holds (surrounding whitespace allowed), or _Malformed."""
    try:
        return _DECODER.decode(text)
    except (ValueError, RecursionError) as error:  # RecursionError: absurdly deep nesting
        raise _Malformed(str(error)) from None


def _dump_json(value: Any) -> str:
    try:
        dumped = json.dumps(value, ensure_ascii=False)
    except (ValueError, RecursionError) as error:
        raise _Malformed(str(error)) from None
    try:
        dumped.encode("utf-8")
    except UnicodeEncodeError:
        # A lone surrogate escape ("\ud800") decodes to a str that UTF-8 cannot hold; keep it escaped.
        dumped = json.dumps(value, ensure_ascii=True)
    return dumped


def _arguments_object(value: Any) -> str:
    if not isinstance(value, dict):
        raise _Malformed("the arguments are not a JSON object")
    return _dump_json(value)


def _call_from_object(call: Any) -> ToolCall:
    """A call written as {"name": ..., "arguments"|"parameters": {...}} (qwen25, llama3)."""
    if not isinstance(call, dict):
        raise _Malformed("a tool call is not a JSON object")
    name = call.get("name")
    if not isinstance(name, str) or not name:
        raise _Malformed("a tool call has no name")
    # Llama writes "parameters", Qwen "arguments"; no arguments at all means none (SGLang: {}).
    arguments = call["parameters"] if "parameters" in call else call.get("arguments", {})
    return ToolCall(name, _arguments_object(arguments))


def _tagged_blocks(text: str, start: int, open_tag: str, close_tag: str) -> list[str]:
    """The bodies of the `open_tag`...`close_tag` blocks from `start` on; an unclosed block is malformed.
    Text between blocks is skipped, as SGLang's findall does."""
    bodies = []
    at = text.find(open_tag, start)
    while at != -1:
        body_start = at + len(open_tag)
        end = text.find(close_tag, body_start)
        if end == -1:
            raise _Malformed(f"{open_tag} without {close_tag}")
        bodies.append(text[body_start:end])
        at = text.find(open_tag, end + len(close_tag))
    return bodies


# An extractor returns (content, calls); no calls means the text holds none. It raises _Malformed.
_Extract = Callable[[str, Collection[str]], tuple[str, list[ToolCall]]]


@dataclass(frozen=True)
class _FormatParser:
    name: str
    _extract: _Extract

    def parse(self, text: str, tool_names: Collection[str]) -> ParsedReply:
        try:
            content, calls = self._extract(text, tool_names)
        except _Malformed:
            return ParsedReply(text, ())
        if not calls:
            return ParsedReply(content, ())
        known = tuple(call for call in calls if call.name in tool_names)
        if not known:
            return ParsedReply(text, ())
        return ParsedReply(content, known)


# --- qwen25 (Hermes style, Qwen2.5 and Qwen3): qwen25_detector.py --------------------------------------

_QWEN_OPEN, _QWEN_CLOSE = "<tool_call>", "</tool_call>"


def _extract_qwen25(text: str, tool_names: Collection[str]) -> tuple[str, list[ToolCall]]:
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, repeated. Content is the text
    before the first call, stripped; text between and after calls is dropped, as SGLang does. SGLang
    needs the newlines inside the tags; any whitespace (or none) is accepted here."""
    first = text.find(_QWEN_OPEN)
    if first == -1:
        return text, []
    calls = []
    for body in _tagged_blocks(text, first, _QWEN_OPEN, _QWEN_CLOSE):
        value = _decode_json(body)
        # SGLang also takes a JSON list of calls inside one block.
        for call in value if isinstance(value, list) else [value]:
            calls.append(_call_from_object(call))
    if not calls:
        raise _Malformed("an empty tool call list")
    return text[:first].strip(), calls


# --- llama3 (Llama 3.1/3.2 JSON tool calls): llama32_detector.py -------------------------------------

_PYTHON_TAG = "<|python_tag|>"
_LEADING_SPACE = re.compile(r"\s*")


def _skip_space(text: str, at: int) -> int:
    match = _LEADING_SPACE.match(text, at)
    assert match is not None  # \s* always matches
    return match.end()


def _extract_llama3(text: str, tool_names: Collection[str]) -> tuple[str, list[ToolCall]]:
    """`{"name": ..., "parameters": {...}}`, several separated by ";", either opening the reply or after
    `<|python_tag|>`. Content is the text before the tag (as written) plus any text after the last call
    (stripped), as SGLang does. SGLang also accepts Python dict syntax; that is malformed here."""
    tag = text.find(_PYTHON_TAG)
    if tag != -1:
        prefix, at = text[:tag], tag + len(_PYTHON_TAG)
    elif text.lstrip().startswith("{"):
        prefix, at = "", 0
    else:
        return text, []
    calls = []
    while True:
        at = _skip_space(text, at)
        if not text.startswith("{", at):
            raise _Malformed("no JSON object where a tool call should start")
        try:
            value, at = _DECODER.raw_decode(text, at)
        except (ValueError, RecursionError) as error:
            raise _Malformed(str(error)) from None
        calls.append(_call_from_object(value))
        at = _skip_space(text, at)
        if not text.startswith(";", at):
            break
        at += 1
        if _skip_space(text, at) == len(text):  # a trailing separator
            break
    return prefix + text[at:].strip(), calls


# --- deepseekv3 (DeepSeek-V3/R1 0324-0528 templates): deepseekv3_detector.py -------------------------

_DS_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
_DS_CALL_BEGIN, _DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
_DS_SEP = "<｜tool▁sep｜>"


def _deepseek_call(body: str) -> ToolCall:
    """`function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```` (the call type before the separator is ignored,
    as SGLang does). The code fence is optional here; SGLang requires it."""
    sep = body.find(_DS_SEP)
    if sep == -1:
        raise _Malformed("a DeepSeek tool call without its separator")
    rest = body[sep + len(_DS_SEP) :]
    newline = rest.find("\n")
    if newline == -1:
        raise _Malformed("a DeepSeek tool call without arguments")
    name, arguments = rest[:newline].strip(), rest[newline + 1 :].strip()
    if not name:
        raise _Malformed("a DeepSeek tool call without a name")
    if arguments.startswith("```"):
        if not arguments.endswith("```") or len(arguments) < 6:
            raise _Malformed("an unclosed code fence")
        arguments = arguments[3:-3]
        if arguments.startswith("json"):
            arguments = arguments[4:]
    return ToolCall(name, _arguments_object(_decode_json(arguments)))


def _extract_deepseekv3(text: str, tool_names: Collection[str]) -> tuple[str, list[ToolCall]]:
    """`<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>...<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`.
    Content is the text before the calls, stripped, as SGLang does."""
    first = text.find(_DS_CALLS_BEGIN)
    if first == -1:
        return text, []
    calls = [_deepseek_call(body) for body in _tagged_blocks(text, first, _DS_CALL_BEGIN, _DS_CALL_END)]
    if not calls:
        raise _Malformed("a DeepSeek tool call section without calls")
    return text[:first].strip(), calls


# --- gpt-oss (OpenAI harmony format): gpt_oss_detector.py with parser/harmony_parser.py --------------


def _harmony_recipient_name(recipient: str) -> str:
    # Function tools live in the "functions" namespace; built-in tools (browser.search, python) keep
    # their full name, so they cannot be mistaken for a user function. (SGLang keeps the last dotted part.)
    return recipient.removeprefix("functions.")


def _extract_gpt_oss(text: str, tool_names: Collection[str]) -> tuple[str, list[ToolCall]]:
    """Harmony messages (`harmony_text.py`): `<|channel|>analysis<|message|>...<|end|>` (reasoning, never
    content), `<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}
    <|call|>` (a call; its <|call|> may have been removed as the stop token), commentary without a
    recipient (a preamble) and `<|channel|>final<|message|>...`. Content is the preambles, the final text
    and text outside messages (what the `gpt-oss` reasoning parser left), joined by a space and stripped,
    as SGLang's detector returns them; text with no harmony marker is all content."""
    if not is_harmony(text):
        return text, []
    messages, stray = harmony_messages(text)
    content_parts = [part for part in stray if part.strip()]
    calls = []
    for message in messages:
        recipient = message.recipient
        if recipient is not None:
            if message.body is None:
                raise _Malformed("a harmony tool call cut off before its arguments")
            if message.body.strip():
                arguments = _decode_json(message.body)
            elif message.terminated:
                arguments = {}  # a call without arguments (SGLang: {})
            else:  # the text ends at <|message|>: cut off, not a call without arguments
                raise _Malformed("a harmony tool call cut off before its arguments")
            calls.append(ToolCall(_harmony_recipient_name(recipient), _arguments_object(arguments)))
        elif message.body is not None and message.channel != "analysis":
            content_parts.append(message.body)
    return " ".join(part for part in content_parts if part).strip(), calls


# --- glm45 (GLM-4.5/4.6): glm4_moe_detector.py --------------------------------------------------------

_GLM_KEY_OPEN, _GLM_KEY_CLOSE = "<arg_key>", "</arg_key>"
_GLM_VALUE_OPEN, _GLM_VALUE_CLOSE = "<arg_value>", "</arg_value>"


def _expect(text: str, at: int, tag: str) -> int:
    """Position after `tag`, which must follow `at` after whitespace only."""
    at = _skip_space(text, at)
    if not text.startswith(tag, at):
        raise _Malformed(f"expected {tag}")
    return at + len(tag)


def _glm_value(raw: str) -> Any:
    # Without the tools' schemas a value is JSON when it parses as JSON, else the string as written.
    # (SGLang keeps a value whose schema type is "string" as a string even when it parses, e.g. "42".)
    try:
        return _DECODER.decode(raw)
    except (ValueError, RecursionError):
        return raw


def _glm_call(body: str) -> ToolCall:
    """`NAME\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n...`: pairs separated by whitespace."""
    first_key = body.find(_GLM_KEY_OPEN)
    name_end = len(body) if first_key == -1 else first_key
    newline = body.find("\n", 0, name_end)
    if newline != -1:
        name_end = newline
    name = body[:name_end].strip()
    if not name:
        raise _Malformed("a GLM tool call without a name")
    arguments: dict[str, Any] = {}
    at = name_end
    while _skip_space(body, at) < len(body):
        key_start = _expect(body, at, _GLM_KEY_OPEN)
        key_end = body.find(_GLM_KEY_CLOSE, key_start)
        if key_end == -1:
            raise _Malformed("an unclosed <arg_key>")
        value_start = _expect(body, key_end + len(_GLM_KEY_CLOSE), _GLM_VALUE_OPEN)
        value_end = body.find(_GLM_VALUE_CLOSE, value_start)
        if value_end == -1:
            raise _Malformed("an unclosed <arg_value>")
        arguments[body[key_start:key_end].strip()] = _glm_value(body[value_start:value_end])
        at = value_end + len(_GLM_VALUE_CLOSE)
    return ToolCall(name, _dump_json(arguments))


def _extract_glm45(text: str, tool_names: Collection[str]) -> tuple[str, list[ToolCall]]:
    """`<tool_call>NAME\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n</tool_call>`, repeated.
    Content is the text before the first call, stripped, as SGLang does."""
    first = text.find(_QWEN_OPEN)
    if first == -1:
        return text, []
    calls = [_glm_call(body) for body in _tagged_blocks(text, first, _QWEN_OPEN, _QWEN_CLOSE)]
    return text[:first].strip(), calls


# --- kimi_k2 (Kimi-K2): kimik2_detector.py ------------------------------------------------------------

_KIMI_SECTION_BEGIN = "<|tool_calls_section_begin|>"
_KIMI_CALL_BEGIN, _KIMI_CALL_END = "<|tool_call_begin|>", "<|tool_call_end|>"
_KIMI_ARGUMENTS_BEGIN = "<|tool_call_argument_begin|>"
_KIMI_CALL_ID = re.compile(r"(?:functions\.)?([\w.\-]+):\d+")
_KIMI_COUNTER = re.compile(r"\d+")


def _kimi_call(body: str, tool_names: Collection[str]) -> ToolCall:
    """`functions.NAME:INDEX<|tool_call_argument_begin|>{...}`; the id is kept as the call's id."""
    split = body.find(_KIMI_ARGUMENTS_BEGIN)
    if split == -1:
        raise _Malformed("a Kimi tool call without arguments")
    call_id, arguments = body[:split].strip(), body[split + len(_KIMI_ARGUMENTS_BEGIN) :].strip()
    standard = _KIMI_CALL_ID.fullmatch(call_id)
    if standard is not None:
        name = standard.group(1)
    elif _KIMI_COUNTER.fullmatch(call_id) and len(tool_names) == 1:
        # A bare call counter with one tool offered: SGLang infers that tool; with several it would
        # guess from argument keys and the tools' schemas, which this parser does not see.
        (name,) = tool_names
    else:
        raise _Malformed(f"a Kimi tool call id that names no function: {call_id[:100]!r}")
    _arguments_object(_decode_json(arguments))  # validated; passed on as the model wrote it, as SGLang does
    return ToolCall(name, arguments, call_id)


def _extract_kimi_k2(text: str, tool_names: Collection[str]) -> tuple[str, list[ToolCall]]:
    """`<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}
    <|tool_call_end|><|tool_calls_section_end|>`. Content is the text before the section, unstripped, as
    SGLang does. (SGLang keeps calls to functions not offered for this parser; they are dropped here like
    every other parser's.)"""
    first = text.find(_KIMI_SECTION_BEGIN)
    if first == -1:
        return text, []
    bodies = _tagged_blocks(text, first, _KIMI_CALL_BEGIN, _KIMI_CALL_END)
    if not bodies:
        raise _Malformed("a Kimi tool call section without calls")
    return text[:first], [_kimi_call(body, tool_names) for body in bodies]


_PARSERS: dict[str, _FormatParser] = {
    parser.name: parser
    for parser in (
        _FormatParser("qwen25", _extract_qwen25),
        _FormatParser("llama3", _extract_llama3),
        _FormatParser("deepseekv3", _extract_deepseekv3),
        _FormatParser("gpt-oss", _extract_gpt_oss),
        _FormatParser("glm45", _extract_glm45),
        _FormatParser("kimi_k2", _extract_kimi_k2),
    )
}

TOOL_CALL_PARSER_NAMES: frozenset[str] = frozenset(_PARSERS)


def tool_call_parser(name: str) -> ToolCallParser:
    """The parser SGLang's `--tool-call-parser NAME` selects; ValueError naming the known ones otherwise."""
    parser = _PARSERS.get(name)
    if parser is None:
        known = ", ".join(sorted(TOOL_CALL_PARSER_NAMES))
        raise ValueError(f"unknown tool-call parser {name!r}; known parsers: {known}")
    return parser
