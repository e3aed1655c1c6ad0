"""The grammar of a forced tool call (tool_grammar.py, json_grammar.py), checked with the real xgrammar
(SGLang's default grammar backend): it accepts the replies each family's model writes when it calls a
tool (the test kit's reply writers, written from the families' formats) and what the proxy's parser
reads as that call, and refuses text, other functions and arguments outside the tool's schema."""

from __future__ import annotations

import json

import pytest
import xgrammar
from rolloutfleet_proxy.chat_tools import parse_tools
from rolloutfleet_proxy.continuation import restarts_after_abort
from rolloutfleet_proxy.errors import ProxyError
from rolloutfleet_proxy.json_grammar import JsonGrammar, literal
from rolloutfleet_proxy.openai_format import parse_chat_request
from rolloutfleet_proxy.reasoning_parsers import reasoning_parser
from rolloutfleet_proxy.tool_grammar import (
    CONSTRAINABLE_PARSERS,
    ReasoningStart,
    Tool,
    forced_call_grammar,
    reasoning_start,
    text_until,
    tool_choice_grammar,
)
from rolloutfleet_proxy.tool_parsers import TOOL_CALL_PARSER_NAMES, tool_call_parser
from rolloutfleet_testkit.model_families.replies import (
    deepseek_r1_reply,
    glm45_reply,
    llama31_reply,
    qwen3_reply,
    qwen25_reply,
)
from xgrammar.testing import _is_grammar_accept_string

WEATHER = Tool(
    "get_weather",
    {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}},
        "required": ["city"],
    },
)
CALC = Tool("calculator", {"type": "object", "properties": {"expression": {"type": "string"}}})
TOOLS = [WEATHER, CALC]


def accepts(ebnf: str, text: str) -> bool:
    return _is_grammar_accept_string(xgrammar.Grammar.from_ebnf(ebnf), text)


def arguments_grammar(schema: dict) -> str:
    grammar = JsonGrammar("t")
    return f"root ::= {grammar.value(schema)}\n{grammar.rules()}"


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 4},
        "count": {"type": "integer"},
        "ratio": {"type": ["number", "null"]},
        "flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2},
        "mode": {"const": "fast"},
        "nested": {
            "type": "object",
            "properties": {"k": {"anyOf": [{"type": "string"}, {"type": "integer"}]}},
        },
        "free": {"$ref": "#/$defs/x"},
    },
    "required": ["name", "flags"],
}


@pytest.mark.parametrize(
    ("text", "valid"),
    [
        ('{"name": "ab", "flags": [true]}', True),
        ('{"name": "ab", "count": -3, "ratio": 1.5e-3, "flags": [false, true], "mode": "fast"}', True),
        ('{"name": "ab", "flags": [true], "nested": {"k": 4}, "free": {"any": [1, "x", null]}}', True),
        ('{"name": "ab", "ratio": null, "flags": [true], "nested": {}}', True),
        ('{"name": "ab", "flags": [true], "nested": {"k": "\\u00e9\\n\\""}}', True),  # escapes
        ('{"name": "\\n", "flags": [true]}', False),  # a bounded string holds plain characters only
        ('{"flags": [true]}', False),  # a required property missing
        ('{"name": "", "flags": [true]}', False),  # minLength
        ('{"name": "abcde", "flags": [true]}', False),  # maxLength
        ('{"name": "ab", "flags": []}', False),  # minItems
        ('{"name": "ab", "flags": [true, true, true]}', False),  # maxItems
        ('{"name": "ab", "count": 1.5, "flags": [true]}', False),  # an integer
        ('{"name": "ab", "flags": [true], "mode": "slow"}', False),  # const
        ('{"flags": [true], "name": "ab"}', False),  # the schema's order
        ('{"name": "ab", "flags": [true], "other": 1}', False),  # no other properties
        ('{"name":"ab","flags":[true]}', False),  # json.dumps' layout only
        ('{"name": "ab", "flags": [true]} ', False),
    ],
)
def test_arguments_follow_the_tools_schema(text, valid):
    assert accepts(arguments_grammar(SCHEMA), text) is valid


def test_a_schema_without_properties_or_type_is_any_json_object_or_value():
    assert accepts(arguments_grammar({"type": "object"}), '{"a": [1, {"b": null}]}')
    assert not accepts(arguments_grammar({"type": "object"}), "[1]")
    assert accepts(arguments_grammar({}), "[1, true]")


def test_literals_escape_quotes_backslashes_and_controls():
    assert accepts(f"root ::= {literal(chr(34) + chr(92) + chr(10) + chr(1) + 'é')}", '"\\\n\x01é')


@pytest.mark.parametrize(
    ("end", "text", "valid"),
    [
        ("</think>", "plain</think>", True),
        ("</think>", "a</thin</think>", True),
        ("</think>", "<<</think>", True),
        ("</think>", "</think>", True),
        ("</think>", "no end", False),
        ("</think>", "x</think>more", False),  # the first end tag ends the text
        ("aab", "aaab", True),  # a partial match that falls back to a shorter one
        ("◁/think▷", "◁x◁/think▷", True),
    ],
)
def test_text_until_ends_at_the_first_end_tag(end, text, valid):
    assert accepts("root ::= u_0\n" + "\n".join(text_until(end, "u")), text) is valid


# Each family's call reply as its model writes it (without the stop token), by parser name.
def _strip(text: str, stop: str) -> str:
    assert text.endswith(stop)
    return text[: -len(stop)]


CALLS = [("get_weather", {"city": "New York", "unit": "f"}), ("calculator", {"expression": "17 * 23"})]
FAMILY_REPLIES = {
    "qwen25": _strip(qwen25_reply(None, "", CALLS), "<|im_end|>"),
    "llama3": _strip(llama31_reply(None, "", CALLS[1:]), "<|eot_id|>"),
    "glm45": _strip(glm45_reply(None, "", CALLS), "<|observation|>"),
    # After the think block the reply is what the proxy parses when no reasoning parser is set.
    "deepseekv3": _strip(deepseek_r1_reply(None, "", CALLS), "<｜end▁of▁sentence｜>").split("</think>\n\n")[
        1
    ],
    # Formats as SGLang's kimik2_detector and gpt_oss_detector read them (docs/proxy.md, model families).
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    '<|tool_call_argument_begin|>{"city": "New York", "unit": "f"}<|tool_call_end|>'
    '<|tool_call_begin|>functions.calculator:1<|tool_call_argument_begin|>{"expression": "17 * 23"}'
    "<|tool_call_end|><|tool_calls_section_end|>",
    "gpt-oss": "<|channel|>analysis<|message|>Need the calculator.<|end|><|start|>assistant"
    '<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>{"expression": "17 * 23"}',
}
ONE_CALL = {"llama3", "gpt-oss"}  # a format or template with one call per turn


def test_every_parser_has_a_grammar():
    assert CONSTRAINABLE_PARSERS == TOOL_CALL_PARSER_NAMES


@pytest.mark.parametrize("parser", sorted(FAMILY_REPLIES))
def test_required_accepts_the_familys_call_reply_which_its_parser_reads(parser):
    reply = FAMILY_REPLIES[parser]
    grammar = forced_call_grammar(parser, TOOLS, None, ReasoningStart.NONE)
    assert accepts(grammar, reply)
    parsed = tool_call_parser(parser).parse(reply, {"get_weather", "calculator"})
    expected = CALLS[1:] if parser in ONE_CALL else CALLS
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == expected
    assert not accepts(grammar, "The weather is fine.")
    assert not accepts(grammar, "Sure. " + reply)  # nothing before the call
    assert not accepts(grammar, reply.replace("calculator", "calculus"))  # only offered functions


@pytest.mark.parametrize("parser", sorted(FAMILY_REPLIES))
def test_a_named_function_allows_that_call_only_once(parser):
    grammar = forced_call_grammar(parser, TOOLS, "calculator", ReasoningStart.NONE)
    reply = FAMILY_REPLIES[parser]
    if parser in ONE_CALL:
        assert accepts(grammar, reply)
    else:
        assert not accepts(grammar, reply)  # two calls, one of them another function
        single = {
            "qwen25": _strip(qwen25_reply(None, "", CALLS[1:]), "<|im_end|>"),
            "glm45": _strip(glm45_reply(None, "", CALLS[1:]), "<|observation|>"),
            "deepseekv3": _strip(deepseek_r1_reply(None, "", CALLS[1:]), "<｜end▁of▁sentence｜>").split(
                "</think>\n\n"
            )[1],
            "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.calculator:0"
            '<|tool_call_argument_begin|>{"expression": "1"}<|tool_call_end|><|tool_calls_section_end|>',
        }[parser]
        assert accepts(grammar, single)
    weather_only = forced_call_grammar(parser, TOOLS, "get_weather", ReasoningStart.NONE)
    assert not accepts(weather_only, reply if parser in ONE_CALL else FAMILY_REPLIES["qwen25"])


def test_arguments_outside_the_schema_are_refused_in_every_format():
    bad = {"city": "Paris", "unit": "kelvin"}
    assert not accepts(
        forced_call_grammar("qwen25", TOOLS, None, ReasoningStart.NONE),
        _strip(qwen25_reply(None, "", [("get_weather", bad)]), "<|im_end|>"),
    )
    assert not accepts(
        forced_call_grammar("glm45", TOOLS, None, ReasoningStart.NONE),
        _strip(glm45_reply(None, "", [("get_weather", bad)]), "<|observation|>"),
    )
    # GLM writes strings raw; one that would read as JSON (a number) is kept out of string arguments.
    assert not accepts(
        forced_call_grammar("glm45", TOOLS, None, ReasoningStart.NONE),
        _strip(glm45_reply(None, "", [("get_weather", {"city": "42"})]), "<|observation|>"),
    )


def test_reasoning_comes_first_where_the_model_writes_it():
    call = [("calculator", {"expression": "1 + 1"})]
    # DeepSeek-R1: the prompt opened the block, so the reply must close it before the call.
    opened = forced_call_grammar("deepseekv3", TOOLS, None, ReasoningStart.OPEN, ("<think>", "</think>"))
    r1 = _strip(deepseek_r1_reply("Add them.", "", call), "<｜end▁of▁sentence｜>")
    assert accepts(opened, r1)
    assert not accepts(opened, r1.split("</think>\n\n")[1])
    # Qwen3 thinking: the model may open a block, or call at once.
    optional = forced_call_grammar("qwen25", TOOLS, None, ReasoningStart.OPTIONAL, ("<think>", "</think>"))
    assert accepts(optional, _strip(qwen3_reply("Add them.", "", call), "<|im_end|>"))
    assert accepts(optional, _strip(qwen3_reply(None, "", call), "<|im_end|>"))
    glm = forced_call_grammar("glm45", TOOLS, None, ReasoningStart.OPTIONAL, ("<think>", "</think>"))
    assert accepts(glm, _strip(glm45_reply("Add them.", "", call), "<|observation|>"))
    # Without reasoning, a think block is text before the call: refused.
    none = forced_call_grammar("qwen25", TOOLS, None, ReasoningStart.NONE)
    assert not accepts(none, _strip(qwen3_reply("Add them.", "", call), "<|im_end|>"))


@pytest.mark.parametrize(
    ("parser", "tail", "expected"),
    [
        (None, "<|im_start|>assistant\n", ReasoningStart.NONE),
        ("qwen3", "<|im_start|>assistant\n", ReasoningStart.OPTIONAL),
        ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", ReasoningStart.NONE),  # thinking off
        ("deepseek-r1", "<｜Assistant｜><think>\n", ReasoningStart.OPEN),
        ("deepseek-r1", "<｜Assistant｜>", ReasoningStart.OPEN),  # a forced parser
        ("glm45", "<|assistant|>", ReasoningStart.OPTIONAL),
        ("glm45", "<|assistant|>\n<think></think>", ReasoningStart.NONE),
        ("kimi", "<|im_assistant|>assistant<|im_middle|>◁think▷", ReasoningStart.OPEN),
    ],
)
def test_where_the_reply_starts_follows_the_prompt(parser, tail, expected):
    parsed = reasoning_parser(parser) if parser else None
    start, end = (parsed.start_tag, parsed.end_tag) if parsed else (None, None)
    assert reasoning_start(start, end, bool(parsed and parsed.forced), tail) is expected


def test_only_required_and_named_choices_get_a_grammar():
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": CALC.parameters}}]
    for choice, forced in [
        ("auto", False),
        ("none", False),
        ("required", True),
        ({"type": "function", "function": {"name": "calculator"}}, True),
    ]:
        spec = parse_tools({"tools": tools, "tool_choice": choice})
        grammar = tool_choice_grammar(spec, "qwen25", None, "<|im_start|>assistant\n")
        assert (grammar is not None) is forced
    assert tool_choice_grammar(None, "qwen25", None, "") is None


def test_a_parser_without_a_grammar_is_refused_with_400_when_a_call_is_forced():
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "calculator"}}],
        "tool_choice": "required",
    }
    with pytest.raises(ProxyError) as refused:
        parse_chat_request(body, 16, tool_parser="pythonic")
    assert refused.value.status == 400 and refused.value.code == "unsupported_parameter"
    assert "pythonic" in refused.value.message
    parse_chat_request({**body, "tool_choice": "auto"}, 16, tool_parser="pythonic")  # not forced: fine


def test_a_constrained_generation_restarts_after_an_abort():
    assert restarts_after_abort({"max_new_tokens": 8, "ebnf": 'root ::= "a"'})
    assert not restarts_after_abort({"max_new_tokens": 8})


def test_a_string_holds_no_utf8_encoded_surrogate(test_tokenizer_dir):
    """xgrammar would take one for a character (a byte-level vocabulary can spell it); no UTF-8 decoder
    does, so the decoded text would hold three replacement characters instead of one."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(test_tokenizer_dir))
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiled = xgrammar.GrammarCompiler(info).compile_grammar(arguments_grammar({"type": "string"}))
    for raw, valid in ((b'"\xe5\x80\x80"', True), (b'"\xed\xa0\x80"', False)):
        assert xgrammar.GrammarMatcher(compiled).accept_string(raw) is valid


def test_parallel_tool_calls_false_allows_one_call():
    grammar = forced_call_grammar("qwen25", TOOLS, None, ReasoningStart.NONE, parallel=False)
    assert not accepts(grammar, FAMILY_REPLIES["qwen25"])
    assert accepts(grammar, _strip(qwen25_reply(None, "", CALLS[:1]), "<|im_end|>"))
    spec = parse_tools(
        {"tools": [{"type": "function", "function": {"name": "f"}}], "parallel_tool_calls": False}
    )
    assert spec is not None and not spec.parallel
    with pytest.raises(ProxyError) as refused:
        parse_tools({"tools": [{"type": "function", "function": {"name": "f"}}], "parallel_tool_calls": "no"})
    assert refused.value.code == "invalid_parameter"


def test_a_requests_grammar_is_kept_for_the_sessions_next_turns():
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": CALC.parameters}}]
    spec = parse_tools({"tools": tools, "tool_choice": "required"})
    first = tool_choice_grammar(spec, "qwen25", None, "")
    assert tool_choice_grammar(spec, "qwen25", None, "") is first  # the same text, not built again
    other = parse_tools({"tools": tools, "tool_choice": "required", "parallel_tool_calls": False})
    assert tool_choice_grammar(other, "qwen25", None, "") != first


def test_a_turns_grammar_follows_its_reasoning_parser_and_prompt():
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": CALC.parameters}}]
    spec = parse_tools({"tools": tools, "tool_choice": "required"})
    call = [("calculator", {"expression": "1 + 1"})]
    r1 = _strip(deepseek_r1_reply("Add them.", "", call), "<｜end▁of▁sentence｜>")
    grammar = tool_choice_grammar(
        spec, "deepseekv3", reasoning_parser("deepseek-r1"), "<｜Assistant｜><think>\n"
    )
    assert grammar is not None and accepts(grammar, r1)
    closed = tool_choice_grammar(
        spec, "qwen25", reasoning_parser("qwen3"), "assistant\n<think>\n\n</think>\n\n"
    )
    assert closed is not None
    assert accepts(closed, _strip(qwen3_reply(None, "", call), "<|im_end|>"))
    assert not accepts(closed, _strip(qwen3_reply("Add them.", "", call), "<|im_end|>"))


def test_glm_string_length_bounds_count_characters():
    tool = Tool("note", {"type": "object", "properties": {"text": {"type": "string", "maxLength": 6}}})
    grammar = forced_call_grammar("glm45", [tool], None, ReasoningStart.NONE)
    for value, valid in (("abcdef", True), ("abcdefg", False), ("12 ab", True), ("12345", False), ("", True)):
        text = _strip(glm45_reply(None, "", [("note", {"text": value})]), "<|observation|>")
        assert accepts(grammar, text) is valid, value
