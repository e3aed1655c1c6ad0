"""Tool-call parsers against text in each model family's own output format (SGLang's detectors' formats)."""

from __future__ import annotations

import json
import random
import time

import pytest
from rolloutfleet_proxy.tool_parsers import (
    TOOL_CALL_PARSER_NAMES,
    ParsedReply,
    ToolCall,
    tool_call_parser,
)

TOOLS = frozenset({"get_weather", "get_time", "search"})


def _reply(content: str, *calls: ToolCall) -> ParsedReply:
    return ParsedReply(content, calls)


def _as_is(text: str) -> ParsedReply:
    """What a parser returns for text with no (valid) tool call: all of it, untouched, as content."""
    return ParsedReply(text, ())


WEATHER_PARIS = ToolCall("get_weather", '{"city": "Paris"}')
TIME_UTC = ToolCall("get_time", '{"timezone": "UTC"}')
NESTED_ARGS = (
    '{"query": "café crème 北京 🚀", '
    '"filters": {"tags": ["a", "b"], "limit": 3, "exact": true, "after": null}}'
)

QWEN25 = [
    pytest.param(
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        _reply("", WEATHER_PARIS),
        id="one-call",
    ),
    pytest.param(
        'Let me look that up.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>',
        _reply("Let me look that up.", WEATHER_PARIS, TIME_UTC),
        id="text-then-two-calls",
    ),
    pytest.param(
        '<tool_call>\n{"name": "search", "arguments": {"query": "café crème 北京 \\ud83d\\ude80", '
        '"filters": {"tags": ["a", "b"], "limit": 3, "exact": true, "after": null}}}\n</tool_call>',
        _reply("", ToolCall("search", NESTED_ARGS)),
        id="nested-unicode-arguments",
    ),
    pytest.param(
        '<tool_call>{"name":"get_time","arguments":{"timezone":"UTC"}}</tool_call>',
        _reply("", TIME_UTC),
        id="no-newlines-inside-tags",
    ),
    pytest.param(
        '<tool_call>\n{"name": "get_time"}\n</tool_call>',
        _reply("", ToolCall("get_time", "{}")),
        id="no-arguments-key",
    ),
    pytest.param(
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\nDone.',
        _reply("", WEATHER_PARIS),
        id="text-after-calls-dropped-like-sglang",
    ),
    pytest.param(
        "The weather in Paris is sunny.\n", _as_is("The weather in Paris is sunny.\n"), id="no-call"
    ),
    pytest.param(
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',
        _as_is('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>'),
        id="bad-json",
    ),
    pytest.param(
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}',
        _as_is('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'),
        id="unclosed",
    ),
    pytest.param(
        '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}\n</tool_call>',
        _as_is(
            '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}\n</tool_call>'
        ),
        id="arguments-not-an-object",
    ),
    pytest.param(
        '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',
        _as_is('<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>'),
        id="missing-name",
    ),
    pytest.param(
        '<tool_call>\n{"name": "get_weather", "arguments": {"temp": NaN}}\n</tool_call>',
        _as_is('<tool_call>\n{"name": "get_weather", "arguments": {"temp": NaN}}\n</tool_call>'),
        id="nan-is-not-json",
    ),
    pytest.param(
        '<tool_call>\n{"name": "delete_everything", "arguments": {}}\n</tool_call>',
        _as_is('<tool_call>\n{"name": "delete_everything", "arguments": {}}\n</tool_call>'),
        id="unknown-function",
    ),
    pytest.param(
        'Sure.\n<tool_call>\n{"name": "delete_everything", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>',
        _reply("Sure.", TIME_UTC),
        id="unknown-function-dropped-known-kept",
    ),
]

LLAMA3 = [
    pytest.param(
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        _reply("", WEATHER_PARIS),
        id="one-call",
    ),
    pytest.param(
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        _reply("", WEATHER_PARIS),
        id="python-tag",
    ),
    pytest.param(
        'I will check.<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "parameters": {"timezone": "UTC"}}',
        _reply("I will check.", WEATHER_PARIS, TIME_UTC),
        id="text-then-two-calls",
    ),
    pytest.param(
        '{"name": "get_time", "arguments": {"timezone": "UTC"}};',
        _reply("", TIME_UTC),
        id="arguments-key-trailing-separator",
    ),
    pytest.param(
        '{"name": "search", "parameters": {"query": "café crème 北京 🚀", '
        '"filters": {"tags": ["a", "b"], "limit": 3, "exact": true, "after": null}}}',
        _reply("", ToolCall("search", NESTED_ARGS)),
        id="nested-unicode-arguments",
    ),
    pytest.param(
        '{"name": "get_weather", "parameters": {"city": "Paris"}}\nI called the weather tool.',
        _reply("I called the weather tool.", WEATHER_PARIS),
        id="text-after-call",
    ),
    pytest.param("It is sunny in Paris.", _as_is("It is sunny in Paris."), id="no-call"),
    pytest.param(
        '{"name": "get_weather", "parameters": {"city": "Paris"}',
        _as_is('{"name": "get_weather", "parameters": {"city": "Paris"}'),
        id="unclosed-json",
    ),
    pytest.param('{"answer": 42}', _as_is('{"answer": 42}'), id="json-without-name"),
    pytest.param(
        '{"name": "get_weather", "parameters": ["Paris"]}',
        _as_is('{"name": "get_weather", "parameters": ["Paris"]}'),
        id="parameters-not-an-object",
    ),
    pytest.param(
        "<|python_tag|>get_weather(city='Paris')",
        _as_is("<|python_tag|>get_weather(city='Paris')"),
        id="not-json-after-tag",
    ),
    pytest.param(
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "param',
        _as_is('{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "param'),
        id="second-call-cut-off",
    ),
    pytest.param(
        '{"name": "launch_rocket", "parameters": {}}',
        _as_is('{"name": "launch_rocket", "parameters": {}}'),
        id="unknown-function",
    ),
]

DS_CALLS, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def _ds_call(name: str, arguments: str) -> str:
    return f"{DS_CALL}function{DS_SEP}{name}\n```json\n{arguments}\n```{DS_CALL_END}"


DS_ONE = DS_CALLS + _ds_call("get_weather", '{"city": "Paris"}') + DS_CALLS_END
DS_BAD_JSON = DS_CALLS + _ds_call("get_weather", '{"city": Paris}') + DS_CALLS_END
DS_NOT_OBJECT = DS_CALLS + _ds_call("get_weather", '"Paris"') + DS_CALLS_END
DS_UNKNOWN = DS_CALLS + _ds_call("rm_rf", "{}") + DS_CALLS_END

DEEPSEEKV3 = [
    pytest.param(DS_ONE, _reply("", WEATHER_PARIS), id="one-call"),
    pytest.param(
        "I'll check both.\n\n"
        + DS_CALLS
        + _ds_call("get_weather", '{"city": "Paris"}')
        + "\n"
        + _ds_call("get_time", '{"timezone":"UTC"}')
        + DS_CALLS_END,
        _reply("I'll check both.", WEATHER_PARIS, TIME_UTC),
        id="text-then-two-calls",
    ),
    pytest.param(
        DS_CALLS + _ds_call("search", NESTED_ARGS) + DS_CALLS_END,
        _reply("", ToolCall("search", NESTED_ARGS)),
        id="nested-unicode-arguments",
    ),
    pytest.param("Paris is sunny today.", _as_is("Paris is sunny today."), id="no-call"),
    pytest.param(DS_BAD_JSON, _as_is(DS_BAD_JSON), id="bad-json"),
    pytest.param(
        DS_ONE[: -len(DS_CALL_END + DS_CALLS_END)],
        _as_is(DS_ONE[: -len(DS_CALL_END + DS_CALLS_END)]),
        id="unclosed-call",
    ),
    pytest.param(
        DS_ONE.replace("function" + DS_SEP, ""),
        _as_is(DS_ONE.replace("function" + DS_SEP, "")),
        id="no-separator",
    ),
    pytest.param(DS_NOT_OBJECT, _as_is(DS_NOT_OBJECT), id="arguments-not-an-object"),
    pytest.param(DS_UNKNOWN, _as_is(DS_UNKNOWN), id="unknown-function"),
]

HARMONY_ANALYSIS = (
    "<|channel|>analysis<|message|>The user wants the weather in Paris. Call get_weather.<|end|>"
)
HARMONY_WEATHER = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city":"Paris"}'
)

GPT_OSS = [
    pytest.param(
        HARMONY_ANALYSIS + HARMONY_WEATHER,
        _reply("", WEATHER_PARIS),
        id="analysis-then-call-stop-token-removed",
    ),
    pytest.param(
        HARMONY_ANALYSIS + HARMONY_WEATHER + "<|call|>",
        _reply("", WEATHER_PARIS),
        id="call-token-kept",
    ),
    pytest.param(
        '<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"timezone": "UTC"}',
        _reply("", TIME_UTC),
        id="call-without-analysis",
    ),
    pytest.param(
        HARMONY_ANALYSIS
        + "<|start|>assistant to=functions.get_time<|channel|>commentary <|constrain|>json"
        + '<|message|>{"timezone":"UTC"}',
        _reply("", TIME_UTC),
        id="recipient-in-role-header",
    ),
    pytest.param(
        "<|channel|>analysis<|message|>Need both.<|end|><|start|>assistant<|channel|>commentary<|message|>"
        "Checking the weather first.<|end|>" + HARMONY_WEATHER,
        _reply("Checking the weather first.", WEATHER_PARIS),
        id="preamble-is-content",
    ),
    pytest.param(
        "<|channel|>analysis<|message|>Search it.<|end|><|start|>assistant<|channel|>commentary "
        "to=functions.search <|constrain|>json<|message|>" + NESTED_ARGS,
        _reply("", ToolCall("search", NESTED_ARGS)),
        id="nested-unicode-arguments",
    ),
    pytest.param(
        "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|><|call|>",
        _reply("", ToolCall("get_time", "{}")),
        id="empty-arguments",
    ),
    pytest.param(
        "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>",
        _as_is("<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>"),
        id="cut-off-at-arguments",
    ),
    pytest.param(
        "<|channel|>analysis<|message|>Easy greeting.<|end|><|start|>assistant<|channel|>final<|message|>"
        "Hello! How can I help?",
        _reply("Hello! How can I help?"),
        id="final-only-is-content",
    ),
    pytest.param(
        "<|channel|>analysis<|message|>Still thinking about the", _reply(""), id="analysis-cut-off-no-content"
    ),
    pytest.param("Plain text, no channels.", _as_is("Plain text, no channels."), id="no-harmony-markers"),
    pytest.param(
        HARMONY_ANALYSIS
        + "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Par',
        _as_is(
            HARMONY_ANALYSIS
            + "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
            '<|message|>{"city": "Par'
        ),
        id="bad-json",
    ),
    pytest.param(
        HARMONY_ANALYSIS
        + "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json",
        _as_is(
            HARMONY_ANALYSIS
            + "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        ),
        id="cut-off-before-arguments",
    ),
    pytest.param(
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>["Paris"]',
        _as_is('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>["Paris"]'),
        id="arguments-not-an-object",
    ),
    pytest.param(
        '<|channel|>analysis to=browser.search<|message|>{"query": "paris weather"}',
        _as_is('<|channel|>analysis to=browser.search<|message|>{"query": "paris weather"}'),
        id="built-in-tool-is-not-user-search",
    ),
    pytest.param(
        "<|channel|>commentary to=functions.format_disk <|constrain|>json<|message|>{}",
        _as_is("<|channel|>commentary to=functions.format_disk <|constrain|>json<|message|>{}"),
        id="unknown-function",
    ),
]

GLM45 = [
    pytest.param(
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
        _reply("", WEATHER_PARIS),
        id="one-call",
    ),
    pytest.param(
        "I'll check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>北京</arg_value>\n"
        "<arg_key>date</arg_key>\n<arg_value>2024-06-27</arg_value>\n</tool_call>\n<tool_call>get_time\n"
        "<arg_key>timezone</arg_key>\n<arg_value>UTC</arg_value>\n</tool_call>",
        _reply(
            "I'll check.",
            ToolCall("get_weather", '{"city": "北京", "date": "2024-06-27"}'),
            TIME_UTC,
        ),
        id="text-then-two-calls",
    ),
    pytest.param(
        "<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>café crème 北京 🚀</arg_value>\n"
        '<arg_key>filters</arg_key>\n<arg_value>{"tags": ["a", "b"], "limit": 3, '
        '"exact": true, "after": null}</arg_value>'
        "\n<arg_key>limit</arg_key>\n<arg_value>5</arg_value>\n<arg_key>exact</arg_key>\n"
        '<arg_value>false</arg_value>\n<arg_key>label</arg_key>\n<arg_value>"quoted"</arg_value>\n'
        "</tool_call>",
        _reply(
            "",
            ToolCall(
                "search",
                '{"query": "café crème 北京 🚀", "filters": {"tags": ["a", "b"], "limit": 3, "exact": true, '
                '"after": null}, "limit": 5, "exact": false, "label": "quoted"}',
            ),
        ),
        id="json-values-decoded-others-strings",
    ),
    pytest.param(
        "<tool_call>get_time\n</tool_call>", _reply("", ToolCall("get_time", "{}")), id="no-arguments"
    ),
    pytest.param("<tool_call>get_time</tool_call>", _reply("", ToolCall("get_time", "{}")), id="name-only"),
    pytest.param("It is sunny in Paris.", _as_is("It is sunny in Paris."), id="no-call"),
    pytest.param(
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n",
        _as_is("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"),
        id="unclosed-call",
    ),
    pytest.param(
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris\n</tool_call>",
        _as_is("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris\n</tool_call>"),
        id="unclosed-value",
    ),
    pytest.param(
        "<tool_call>\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
        _as_is("<tool_call>\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"),
        id="missing-name",
    ),
    pytest.param(
        "<tool_call>get_weather\ncity = Paris\n</tool_call>",
        _as_is("<tool_call>get_weather\ncity = Paris\n</tool_call>"),
        id="not-key-value-pairs",
    ),
    pytest.param(
        "<tool_call>drop_tables\n<arg_key>all</arg_key>\n<arg_value>true</arg_value>\n</tool_call>",
        _as_is("<tool_call>drop_tables\n<arg_key>all</arg_key>\n<arg_value>true</arg_value>\n</tool_call>"),
        id="unknown-function",
    ),
]

KIMI_SECTION, KIMI_SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL, KIMI_ARGS, KIMI_CALL_END = (
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
)


def _kimi_call(call_id: str, arguments: str) -> str:
    return f"{KIMI_CALL}{call_id}{KIMI_ARGS}{arguments}{KIMI_CALL_END}"


KIMI_ONE = KIMI_SECTION + _kimi_call("functions.get_weather:0", '{"city": "Paris"}') + KIMI_SECTION_END
KIMI_BAD_JSON = KIMI_SECTION + _kimi_call("functions.get_weather:0", '{"city": "Paris"') + KIMI_SECTION_END
KIMI_NOT_OBJECT = KIMI_SECTION + _kimi_call("functions.get_weather:0", '["Paris"]') + KIMI_SECTION_END
KIMI_BARE_COUNTER = KIMI_SECTION + _kimi_call("2", '{"city": "Paris"}') + KIMI_SECTION_END
KIMI_UNKNOWN = KIMI_SECTION + _kimi_call("functions.self_destruct:0", "{}") + KIMI_SECTION_END

KIMI_K2 = [
    pytest.param(
        KIMI_ONE,
        _reply("", ToolCall("get_weather", '{"city": "Paris"}', "functions.get_weather:0")),
        id="one-call",
    ),
    pytest.param(
        "Let me check both. "
        + KIMI_SECTION
        + _kimi_call("functions.get_weather:0", '{"city":"Paris"}')
        + _kimi_call("functions.get_time:1", ' {"timezone": "UTC"} ')
        + KIMI_SECTION_END,
        _reply(
            "Let me check both. ",
            ToolCall("get_weather", '{"city":"Paris"}', "functions.get_weather:0"),
            ToolCall("get_time", '{"timezone": "UTC"}', "functions.get_time:1"),
        ),
        id="text-then-two-calls-arguments-as-written",
    ),
    pytest.param(
        KIMI_SECTION + _kimi_call("functions.search:3", NESTED_ARGS) + KIMI_SECTION_END,
        _reply("", ToolCall("search", NESTED_ARGS, "functions.search:3")),
        id="nested-unicode-arguments",
    ),
    pytest.param("Paris is sunny.", _as_is("Paris is sunny."), id="no-call"),
    pytest.param(KIMI_BAD_JSON, _as_is(KIMI_BAD_JSON), id="bad-json"),
    pytest.param(
        KIMI_ONE[: -len(KIMI_CALL_END + KIMI_SECTION_END)],
        _as_is(KIMI_ONE[: -len(KIMI_CALL_END + KIMI_SECTION_END)]),
        id="unclosed-call",
    ),
    pytest.param(KIMI_NOT_OBJECT, _as_is(KIMI_NOT_OBJECT), id="arguments-not-an-object"),
    pytest.param(KIMI_BARE_COUNTER, _as_is(KIMI_BARE_COUNTER), id="bare-counter-with-several-tools"),
    pytest.param(KIMI_UNKNOWN, _as_is(KIMI_UNKNOWN), id="unknown-function"),
]

CASES = [
    pytest.param(name, *case.values, id=f"{name}-{case.id}")
    for name, cases in [
        ("qwen25", QWEN25),
        ("llama3", LLAMA3),
        ("deepseekv3", DEEPSEEKV3),
        ("gpt-oss", GPT_OSS),
        ("glm45", GLM45),
        ("kimi_k2", KIMI_K2),
    ]
    for case in cases
]


@pytest.mark.parametrize(("parser_name", "text", "expected"), CASES)
def test_parse(parser_name: str, text: str, expected: ParsedReply) -> None:
    assert tool_call_parser(parser_name).parse(text, TOOLS) == expected


def test_kimi_bare_counter_names_the_only_tool() -> None:
    assert tool_call_parser("kimi_k2").parse(KIMI_BARE_COUNTER, ["get_weather"]) == _reply(
        "", ToolCall("get_weather", '{"city": "Paris"}', "2")
    )


def test_no_tools_offered_leaves_calls_as_text() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert tool_call_parser("qwen25").parse(text, ()) == _as_is(text)


def test_lone_surrogate_escape_stays_escaped() -> None:
    text = '<tool_call>\n{"name": "search", "arguments": {"query": "\\ud800"}}\n</tool_call>'
    reply = tool_call_parser("qwen25").parse(text, TOOLS)
    assert reply == _reply("", ToolCall("search", '{"query": "\\ud800"}'))
    reply.tool_calls[0].arguments.encode("utf-8")  # a response encoder must be able to send it


VALID_REPLIES = {
    "qwen25": QWEN25[1].values[0],
    "llama3": LLAMA3[2].values[0],
    "deepseekv3": DEEPSEEKV3[1].values[0],
    "gpt-oss": GPT_OSS[4].values[0],
    "glm45": GLM45[2].values[0],
    "kimi_k2": KIMI_K2[1].values[0],
}


@pytest.mark.parametrize("parser_name", sorted(VALID_REPLIES))
def test_every_cut_of_a_reply_parses_without_raising(parser_name: str) -> None:
    """Generation can stop anywhere (max_tokens): every prefix of a valid reply must parse, and one that
    cuts a call off must not return calls with made-up arguments."""
    parser = tool_call_parser(parser_name)
    text = VALID_REPLIES[parser_name]
    full = parser.parse(text, TOOLS)
    assert full.tool_calls
    for end in range(len(text)):
        reply = parser.parse(text[:end], TOOLS)
        for call in reply.tool_calls:
            assert call in full.tool_calls


SOUP_MARKERS = [
    *["<tool_call>", "</tool_call>", "<|python_tag|>", ";", "<arg_key>", "</arg_key>", "<arg_value>"],
    *["</arg_value>", DS_CALLS, DS_CALLS_END, DS_CALL, DS_CALL_END, DS_SEP, "```json", "```", "function"],
    *[KIMI_SECTION, KIMI_SECTION_END, KIMI_CALL, KIMI_ARGS, KIMI_CALL_END, "functions.get_weather:0", "7"],
    *["<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>"],
    *["analysis", "commentary", "final", "to=functions.get_weather", "to=functions.search", "json"],
    *['{"name": "get_weather", "arguments": ', '{"name": "search", "parameters": ', '"name"', "get_time"],
    *[
        '{"city": "Paris"}',
        "{",
        "}",
        "[",
        "]",
        '"',
        "\\",
        ":",
        ",",
        "null",
        "NaN",
        "1e999",
        "\n",
        " ",
        "北京",
    ],
]
# Whole valid calls, so that some soups hold calls among the debris.
SOUP_CALLS = [
    QWEN25[0].values[0],
    LLAMA3[1].values[0],
    DS_ONE,
    HARMONY_WEATHER + "<|call|>",
    GLM45[0].values[0],
    KIMI_ONE,
]


@pytest.mark.parametrize("parser_name", sorted(TOOL_CALL_PARSER_NAMES))
def test_random_marker_soup_never_raises(parser_name: str) -> None:
    """Random mixtures of every format's markers, JSON pieces and whole calls: parsing returns, and the
    calls it finds name an offered tool and carry a JSON object that a UTF-8 response can hold."""
    parser = tool_call_parser(parser_name)
    rng = random.Random(f"soup-{parser_name}")
    found_calls = 0
    for _ in range(3000):
        pieces = [
            rng.choice(SOUP_CALLS if rng.random() < 0.15 else SOUP_MARKERS) for _ in range(rng.randint(1, 12))
        ]
        reply = parser.parse("".join(pieces), TOOLS)
        assert isinstance(reply.content, str)
        for call in reply.tool_calls:
            found_calls += 1
            assert call.name in TOOLS
            assert isinstance(json.loads(call.arguments), dict)
            call.arguments.encode("utf-8")
    assert found_calls > 0


@pytest.mark.parametrize("parser_name", sorted(TOOL_CALL_PARSER_NAMES))
def test_pathological_text_is_parsed_in_linear_time(parser_name: str) -> None:
    parser = tool_call_parser(parser_name)
    openers = (
        "<tool_call>\n{ <|python_tag|>{ <｜tool▁calls▁begin｜><｜tool▁call▁begin｜> <|channel|>commentary "
    )
    texts = [
        openers * 20_000,
        "<tool_call>" + "[" * 100_000,
        "<|python_tag|>" + '{"a":' * 100_000,
        "<|tool_calls_section_begin|><|tool_call_begin|>" + "a" * 200_000,
        "<|channel|>commentary to=functions.get_time<|message|>" + "[" * 100_000,
        "<|start|>assistant" + "<|constrain|>json" * 50_000,
    ]
    started = time.perf_counter()
    for text in texts:
        assert parser.parse(text, TOOLS).tool_calls == ()
    assert time.perf_counter() - started < 5.0


def test_parser_names_are_sglangs() -> None:
    assert (
        frozenset({"qwen25", "llama3", "deepseekv3", "gpt-oss", "glm45", "kimi_k2"}) == TOOL_CALL_PARSER_NAMES
    )
    for name in TOOL_CALL_PARSER_NAMES:
        assert tool_call_parser(name).name == name


def test_unknown_parser_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="hermes") as raised:
        tool_call_parser("hermes")
    for name in TOOL_CALL_PARSER_NAMES:
        assert name in str(raised.value)
