"""The grammar that makes a turn with `tool_choice` "required" or a named function answer with a call.

SGLang builds such a constraint from the tool-call parser's format (`FunctionCallParser.
get_structure_constraint`: the detector's `build_ebnf` through `EBNFComposer` in earlier releases, its
structural tag in later ones) and passes it in the sampling parameters, where its grammar backend
(xgrammar by default) masks every token that would leave the grammar. The proxy builds the same
constraint in the family's own format, so the reply is a call the proxy's parser reads and the
trajectory holds what the model writes when it calls a tool, and sends it as `sampling_params.ebnf`:
sglang-router 0.3.2 passes `ebnf`, `json_schema` and `regex` to the engines but drops `structural_tag`
(and a top-level `require_reasoning`), so EBNF is the form that works behind the router too.

The grammar, by `--tool-call-parser` name: a call, and how several are written (one per reply when the
format or the family's template holds one, or the request says `parallel_tool_calls: false`; a named
function allows one call of it):
- qwen25: `<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>`, `\\n` between calls.
- llama3: `{"name": "NAME", "parameters": ARGS}`, one.
- deepseekv3: `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>`,
  `\\n` between, all inside `<｜tool▁calls▁begin｜>`...`<｜tool▁calls▁end｜>`.
- glm45: `<tool_call>NAME\\n`, `<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n` per argument (a string
  raw, any other value as JSON), `</tool_call>`; `\\n` between calls, and one may lead.
- kimi_k2: `<|tool_call_begin|>functions.NAME:N<|tool_call_argument_begin|>ARGS<|tool_call_end|>`, all
  inside `<|tool_calls_section_begin|>`...`<|tool_calls_section_end|>`.
- gpt-oss: `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS` (its `<|call|>` is the
  stop token), one; an `analysis` message may come first.

ARGS follow the tool's JSON schema (`json_grammar.py`). Reasoning comes first where the model writes it:
SGLang leaves a reasoning block unconstrained (`ReasonerGrammarObject`) only for requests that say they
reason (`require_reasoning`, which the router drops), so the grammar itself allows the block: when the
prompt opened it (DeepSeek-R1's `<think>\\n`, or a forced reasoning parser) the reply must first close it;
when the model may open one itself (Qwen3 thinking), the block is optional; when the prompt closed it
(`enable_thinking: false`) or there is no reasoning parser, the call comes first. The end tag may be
followed by up to two newlines.
"""

from __future__ import annotations

import enum
import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from .chat_tools import ToolSpec
from .json_grammar import JsonGrammar, literal
from .reasoning_parsers import ReasoningParser


class ReasoningStart(enum.Enum):
    NONE = "none"  # no reasoning block before the call
    OPEN = "open"  # the prompt opened the block: the reply starts inside it
    OPTIONAL = "optional"  # the model may open a block before the call


def reasoning_start(
    start_tag: str | None, end_tag: str | None, forced: bool, prompt_tail: str
) -> ReasoningStart:
    """Where the reply starts, from the reasoning parser's tags (None: no reasoning parser) and the text
    the prompt ends with."""
    if start_tag is None or end_tag is None:
        return ReasoningStart.NONE
    opened, closed = prompt_tail.rfind(start_tag), prompt_tail.rfind(end_tag)
    if opened > closed or (forced and opened == closed == -1):
        return ReasoningStart.OPEN
    if closed >= 0 and prompt_tail.rstrip().endswith(end_tag):
        return ReasoningStart.NONE  # the generation prompt holds a closed, empty block
    return ReasoningStart.OPTIONAL


def tool_choice_grammar(
    tools: ToolSpec | None, parser: str | None, reasoning: ReasoningParser | None, prompt_tail: str
) -> str | None:
    """The EBNF a turn's generation must follow: None unless its tool_choice forces a call. `prompt_tail`
    is the text the turn's prompt ends with (its new messages and generation prompt). A session sends
    the same tools every turn: the grammars of recent requests are kept (`_GRAMMARS`)."""
    if tools is None or parser is None or not tools.forces_call:
        return None
    start = reasoning_start(
        reasoning.start_tag if reasoning else None,
        reasoning.end_tag if reasoning else None,
        reasoning.forced if reasoning else False,
        prompt_tail,
    )
    tags = (reasoning.start_tag, reasoning.end_tag) if reasoning else None
    # The tools as sent (their properties' order shapes the grammar), with everything else it depends on.
    key = (orjson.dumps(tools.tools), parser, tools.forced_name, start, tags, tools.parallel)
    with _GRAMMARS_LOCK:
        grammar = _GRAMMARS.get(key)
        if grammar is not None:
            _GRAMMARS.move_to_end(key)
            return grammar
    offered = [Tool(t["function"]["name"], t["function"].get("parameters")) for t in tools.tools]
    grammar = forced_call_grammar(parser, offered, tools.forced_name, start, tags, tools.parallel)
    with _GRAMMARS_LOCK:
        _GRAMMARS[key] = grammar
        if len(_GRAMMARS) > _GRAMMARS_KEPT:
            _GRAMMARS.popitem(last=False)
    return grammar


# Building the grammar of many tools takes milliseconds (bench/tool_choice.py); a grammar is ~1 KB a tool.
# Many tools' grammars are built in a worker thread (turns.py), hence the lock.
_GRAMMARS: OrderedDict[tuple, str] = OrderedDict()
_GRAMMARS_KEPT = 64
_GRAMMARS_LOCK = threading.Lock()
# From this many tools a grammar not kept yet is built off the event loop (a few milliseconds).
OFFLOAD_TOOLS = 16


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: Mapping[str, Any] | None


@dataclass(frozen=True)
class _Format:
    call_begin: str  # before the call's name
    name_end: str  # between the name and the arguments (an EBNF expression when `name_end_ebnf`)
    call_end: str
    separator: str | None = None  # between calls; None: one call per reply
    section: tuple[str, str] | None = None  # around all the calls
    leading: str | None = None  # may come before the first call
    arguments: str = "json"  # "json": a JSON object; "glm": GLM's key/value pairs
    name_end_ebnf: bool = False


_DS = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
_FORMATS: dict[str, _Format] = {
    "qwen25": _Format('<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>", separator="\n"),
    "llama3": _Format('{"name": "', '", "parameters": ', "}"),
    "deepseekv3": _Format(
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>",
        "\n```json\n",
        "\n```<｜tool▁call▁end｜>",
        separator="\n",
        section=_DS,
    ),
    "glm45": _Format("<tool_call>", "\n", "</tool_call>", separator="\n", leading="\n", arguments="glm"),
    "kimi_k2": _Format(
        "<|tool_call_begin|>functions.",
        '":" [0-9]{1,4} "<|tool_call_argument_begin|>"',  # the call's counter in the conversation
        "<|tool_call_end|>",
        separator="",
        section=("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
        name_end_ebnf=True,
    ),
    "gpt-oss": _Format("<|channel|>commentary to=functions.", " <|constrain|>json<|message|>", ""),
}
CONSTRAINABLE_PARSERS = frozenset(_FORMATS)
_HARMONY_ANALYSIS = ("<|channel|>analysis<|message|>", "<|end|>", "<|start|>assistant")
# GLM writes a string argument as raw text, and the parser reads a value as JSON when it parses as JSON:
# a string value is kept from reading as JSON. It starts with a character no JSON value starts with, or
# like a number but then holds a character no number has ("17 * 23"). It never holds "<" (its end tag
# starts with one). The exact words true, false and null still read as JSON (a known limit).
_GLM_PLAIN_FIRST = r'[^<"\[{0-9\- \t\r\n\uD800-\uDFFF]'
_GLM_NUMBER_CHAR = r"[0-9.eE+\-]"
_GLM_NOT_NUMBER = r"[^<0-9.eE+\-\uD800-\uDFFF]"
_GLM_TEXT = r"[^<\uD800-\uDFFF]"
_GLM_VALUE_END = literal("</arg_value>\n")
_GLM_MAX_COUNTED = 64  # maxLength is followed up to this; a longer bound leaves the length free


def forced_call_grammar(
    parser: str,
    tools: Sequence[Tool],
    forced_name: str | None,
    reasoning: ReasoningStart,
    reasoning_tags: tuple[str, str] | None = None,
    parallel: bool = True,
) -> str:
    """The EBNF (xgrammar's dialect, SGLang's `sampling_params.ebnf`) of a reply that is one or more calls
    of `tools` (only `forced_name`, once, when given; one call without `parallel`) in the format of
    `parser`. ValueError for a parser without a format here."""
    form = _FORMATS.get(parser)
    if form is None:
        raise ValueError(f"no tool-call grammar for the parser {parser!r}")
    chosen = [t for t in tools if forced_name is None or t.name == forced_name]
    if not chosen:
        raise ValueError(f"no tool named {forced_name!r}")
    grammar = JsonGrammar("arg")
    rules: list[str] = []
    calls = [_call(form, tool, grammar) for tool in chosen]
    rules.append("call ::= " + " | ".join(calls))
    several = parallel and forced_name is None and form.separator is not None
    body = f"call ( {literal(form.separator or '')} call )*" if several else "call"
    if form.section is not None:
        body = f"{literal(form.section[0])} {body} {literal(form.section[1])}"
    if form.leading is not None:
        body = f"{literal(form.leading)}? {body}"
    prefix = ""
    if reasoning is not ReasoningStart.NONE and reasoning_tags is not None:
        start, end = reasoning_tags
        rules.extend(text_until(end, "think"))
        block = f"think_0 {_NEWLINES}"
        if reasoning is ReasoningStart.OPTIONAL:  # GLM writes a newline before its think tag
            block = f'( "\\n"? {literal(start)} {block} )?'
        prefix = block + " "
    if parser == "gpt-oss":  # harmony: an analysis message may come before the call
        opening, closing, restart = _HARMONY_ANALYSIS
        rules.extend(text_until(closing, "analysis"))
        prefix += f"( {literal(opening)} analysis_0 {literal(restart)} )? "
    return "\n".join([f"root ::= {prefix}{body}", *rules, grammar.rules()])


_NEWLINES = '( "\\n" "\\n"? )?'


def _call(form: _Format, tool: Tool, grammar: JsonGrammar) -> str:
    if form.arguments == "glm":
        arguments = _glm_arguments(tool.parameters, grammar)
    else:
        arguments = grammar.value(
            dict(tool.parameters) if tool.parameters is not None else {"type": "object"}
        )
    if form.name_end_ebnf:
        head = f"{literal(form.call_begin + tool.name)} {form.name_end}"
    else:
        head = literal(form.call_begin + tool.name + form.name_end)
    end = f" {literal(form.call_end)}" if form.call_end else ""
    return f"( {head} {arguments}{end} )"


def _glm_arguments(parameters: Mapping[str, Any] | None, grammar: JsonGrammar) -> str:
    """GLM's `<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n` per argument, in the schema's order,
    the required ones present: a string value raw, any other as JSON (what GLM's template writes)."""
    properties = (parameters or {}).get("properties")
    if not isinstance(properties, Mapping) or not properties:
        return '""'
    required = set((parameters or {}).get("required") or ())
    items = []
    for name, schema in properties.items():
        value = _glm_value(schema, grammar)
        key = literal(f"<arg_key>{name}</arg_key>\n<arg_value>")
        item = f"{key} {value} {_GLM_VALUE_END}"
        items.append(item if name in required else f"( {item} )?")
    return " ".join(items)


def _glm_value(schema: Any, grammar: JsonGrammar) -> str:
    if (
        isinstance(schema, Mapping)
        and schema.get("type") == "string"
        and not ("enum" in schema or "const" in schema)
    ):
        return grammar.rule(_glm_text(schema.get("minLength", 0), schema.get("maxLength")))
    if isinstance(schema, Mapping) and isinstance(schema.get("enum") or None, list):
        return "( " + " | ".join(_glm_literal(v) for v in schema["enum"]) + " )"
    if isinstance(schema, Mapping) and "const" in schema:
        return _glm_literal(schema["const"])
    return grammar.value(schema)


def _glm_text(low: Any, high: Any) -> str:
    """A raw GLM string value that does not read as JSON, of at most `high` characters."""
    if not isinstance(high, int) or isinstance(high, bool) or high > _GLM_MAX_COUNTED:
        plain = f"{_GLM_PLAIN_FIRST} {_GLM_TEXT}*"
        numberish = f"[0-9\\-] {_GLM_NUMBER_CHAR}* {_GLM_NOT_NUMBER} {_GLM_TEXT}*"
        text = f"{plain} | {numberish}"
    elif high < 1:
        return '""'
    else:
        options = [f"{_GLM_PLAIN_FIRST} {_GLM_TEXT}{{0,{high - 1}}}"]
        for digits in range(high - 1):  # a number-like start of 1 + digits characters, then a non-number one
            tail = f"{_GLM_TEXT}{{0,{high - 2 - digits}}}"
            options.append(f"[0-9\\-] {_GLM_NUMBER_CHAR}{{{digits}}} {_GLM_NOT_NUMBER} {tail}")
        text = " | ".join(options)
    empty_allowed = not (isinstance(low, int) and low > 0)
    return f"( {text} )?" if empty_allowed else f"( {text} )"


def _glm_literal(value: Any) -> str:
    return literal(value) if isinstance(value, str) else literal(json.dumps(value, ensure_ascii=False))


def text_until(end: str, name: str) -> list[str]:
    """Rules `NAME_0 ...` for any text up to and including the first `end`: a matcher of `end` whose state
    k means the text so far ends with end[:k] (and holds no `end`); each character moves it to the longest
    prefix of `end` the text then ends with, and the last character of `end` ends the text."""

    def step(state: int, char: str) -> int:
        seen = end[:state] + char
        return next(
            length for length in range(min(len(end), len(seen)), -1, -1) if seen.endswith(end[:length])
        )

    alphabet = sorted(set(end))
    others = "[^" + "".join(_class_char(c) for c in alphabet) + "]"
    rules = []
    for state in range(len(end)):
        options = []
        for char in alphabet:
            target = step(state, char)
            options.append(literal(char) if target == len(end) else f"{literal(char)} {name}_{target}")
        options.append(f"{others} {name}_0")
        rules.append(f"{name}_{state} ::= " + " | ".join(options))
    return rules


def _class_char(char: str) -> str:
    return "\\" + char if char in "]\\^-[" else char
