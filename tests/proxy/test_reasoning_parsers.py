"""Reasoning parsers against replies in each model family's own format (SGLang's reasoning detectors)."""

# Chinese text uses fullwidth punctuation, meant literally.
# ruff: noqa: RUF001

from __future__ import annotations

import pytest
from rolloutfleet_proxy.reasoning_parsers import REASONING_PARSER_NAMES, SplitReply, reasoning_parser

HARMONY_CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}'
)
QWEN3_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
GLM_CALL = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"

CASES = [
    # qwen3: reasoning only when the reply opens with <think> or the prompt opened it.
    pytest.param(
        "qwen3",
        "<think>\nThe user greets me. I should greet back.\n</think>\n\nHello! How can I help you today?",
        False,
        SplitReply("The user greets me. I should greet back.", "Hello! How can I help you today?"),
        id="qwen3-tag-at-start",
    ),
    pytest.param(
        "qwen3",
        "  \n<think>\nShort.\n</think>\n\nHi.",
        False,
        SplitReply("Short.", "Hi."),
        id="qwen3-whitespace-before-tag",
    ),
    pytest.param(
        "qwen3", "Hello! How can I help?", False, SplitReply(None, "Hello! How can I help?"), id="qwen3-none"
    ),
    pytest.param(
        "qwen3",
        "\n\nHello!\n",
        False,
        SplitReply(None, "\n\nHello!\n"),
        id="qwen3-no-reasoning-text-untouched",
    ),
    pytest.param(
        "qwen3",
        "<think>\n\n</think>\n\nHello!",
        False,
        SplitReply(None, "Hello!"),
        id="qwen3-empty-think-block",
    ),
    pytest.param(
        "qwen3",
        "The user wants the weather.\n</think>\n\nLet me check.",
        True,
        SplitReply("The user wants the weather.", "Let me check."),
        id="qwen3-prompt-opened",
    ),
    pytest.param(
        "qwen3",
        "The user wants the weather.\n</think>\n\nLet me check.",
        False,
        SplitReply(None, "The user wants the weather.\n</think>\n\nLet me check."),
        id="qwen3-end-tag-without-opening-is-content",
    ),
    pytest.param(
        "qwen3",
        "<think>\nLet me work through this step by",
        False,
        SplitReply("Let me work through this step by", ""),
        id="qwen3-no-end-tag-all-reasoning",
    ),
    pytest.param(
        "qwen3",
        "<think>\nI need the weather in Paris.\n" + QWEN3_CALL,
        False,
        SplitReply("I need the weather in Paris.", QWEN3_CALL),
        id="qwen3-tool-call-ends-unclosed-reasoning",
    ),
    pytest.param(
        "qwen3",
        "<think>\nI need the weather.\n</think>\n\n" + QWEN3_CALL,
        False,
        SplitReply("I need the weather.", QWEN3_CALL),
        id="qwen3-reasoning-then-tool-call",
    ),
    pytest.param(
        "qwen3",
        "Sure: <think>not at the start</think> done",
        False,
        SplitReply(None, "Sure: <think>not at the start</think> done"),
        id="qwen3-tag-mid-reply-is-content",
    ),
    pytest.param(
        "qwen3",
        "<think>思考：用户用中文问候。</think>你好！",
        False,
        SplitReply("思考：用户用中文问候。", "你好！"),
        id="qwen3-unicode",
    ),
    pytest.param(
        "qwen3",
        "<think>a</think>b</think>c",
        False,
        SplitReply("a", "b</think>c"),
        id="qwen3-first-end-tag-splits",
    ),
    # qwen3-thinking and deepseek-r1 are forced: the template opened <think> in the prompt.
    pytest.param(
        "qwen3-thinking",
        "Okay, the user asks 2+2.\n</think>\n\n2 + 2 = 4.",
        False,
        SplitReply("Okay, the user asks 2+2.", "2 + 2 = 4."),
        id="qwen3-thinking-forced",
    ),
    pytest.param(
        "qwen3-thinking",
        "<think>\nOkay.\n</think>\n\nFour.",
        False,
        SplitReply("Okay.", "Four."),
        id="qwen3-thinking-tag-kept",
    ),
    pytest.param(
        "qwen3-thinking",
        "Okay, let me compute this carefully",
        False,
        SplitReply("Okay, let me compute this carefully", ""),
        id="qwen3-thinking-no-end-tag",
    ),
    pytest.param(
        "deepseek-r1",
        "Okay, so the user wants a haiku.\n</think>\n\n"
        "Autumn moonlight—\na worm digs silently\ninto the chestnut.",
        False,
        SplitReply(
            "Okay, so the user wants a haiku.", "Autumn moonlight—\na worm digs silently\ninto the chestnut."
        ),
        id="deepseek-r1-forced",
    ),
    pytest.param(
        "deepseek-r1",
        "<think>\nHmm.\n</think>\n\nYes.",
        False,
        SplitReply("Hmm.", "Yes."),
        id="deepseek-r1-0528-writes-the-tag",
    ),
    pytest.param(
        "deepseek-r1",
        "Just an answer without thinking.",
        False,
        SplitReply("Just an answer without thinking.", ""),
        id="deepseek-r1-no-end-tag-all-reasoning",
    ),
    pytest.param(
        "deepseek-r1",
        "Thinking...\n" + QWEN3_CALL,
        False,
        SplitReply("Thinking...\n" + QWEN3_CALL, ""),
        id="deepseek-r1-no-tool-start-interrupt",
    ),
    # glm45: like qwen3 (GLM-4.5 opens <think> itself unless thinking is off).
    pytest.param(
        "glm45",
        "<think>The user wants the weather in Paris.</think>\n" + GLM_CALL,
        False,
        SplitReply("The user wants the weather in Paris.", GLM_CALL),
        id="glm45-reasoning-then-tool-call",
    ),
    pytest.param(
        "glm45",
        "<think>Need the weather.\n" + GLM_CALL,
        False,
        SplitReply("Need the weather.", GLM_CALL),
        id="glm45-tool-call-ends-unclosed-reasoning",
    ),
    pytest.param("glm45", "\nIt is sunny.", False, SplitReply(None, "\nIt is sunny."), id="glm45-none"),
    pytest.param(
        "glm45",
        "Thinking already open.</think>Answer.",
        True,
        SplitReply("Thinking already open.", "Answer."),
        id="glm45-prompt-opened",
    ),
    # kimi: its own tags.
    pytest.param(
        "kimi",
        "◁think▷The image shows a cat.◁/think▷It is a cat.",
        False,
        SplitReply("The image shows a cat.", "It is a cat."),
        id="kimi-tags",
    ),
    pytest.param(
        "kimi",
        "<think>not Kimi's tag</think>Answer",
        False,
        SplitReply(None, "<think>not Kimi's tag</think>Answer"),
        id="kimi-ignores-think-tags",
    ),
    pytest.param(
        "kimi",
        "◁think▷Cut off before the end",
        False,
        SplitReply("Cut off before the end", ""),
        id="kimi-no-end-tag",
    ),
    pytest.param(
        "kimi",
        "Opened by the prompt.◁/think▷\n Answer \n",
        True,
        SplitReply("Opened by the prompt.", "Answer"),
        id="kimi-prompt-opened",
    ),
    # gpt-oss: channels, not tags (SGLang's GptOssDetector). The stop token (<|return|>, <|call|>) was
    # removed before parsing.
    pytest.param(
        "gpt-oss",
        "<|channel|>analysis<|message|>The user greets me.<|end|><|start|>assistant<|channel|>final"
        "<|message|>Hello! How can I help?",
        False,
        SplitReply("The user greets me.", "Hello! How can I help?"),
        id="gpt-oss-analysis-then-final",
    ),
    pytest.param(
        "gpt-oss",
        "<|channel|>analysis<|message|>Need the weather.<|end|>" + HARMONY_CALL,
        False,
        SplitReply("Need the weather.", HARMONY_CALL),
        id="gpt-oss-a-call-stays-as-written",
    ),
    pytest.param(
        "gpt-oss",
        "<|channel|>analysis<|message|>Check first.<|end|><|start|>assistant<|channel|>commentary"
        "<|message|>Let me look that up.<|end|>" + HARMONY_CALL,
        False,
        SplitReply("Check first.", "Let me look that up. " + HARMONY_CALL),
        id="gpt-oss-preamble-is-content",
    ),
    pytest.param(
        "gpt-oss",
        "<|channel|>final<|message|>Just the answer.",
        False,
        SplitReply(None, "Just the answer."),
        id="gpt-oss-final-only",
    ),
    pytest.param(
        "gpt-oss",
        "<|channel|>analysis<|message|>Cut off in the middle of",
        False,
        SplitReply("Cut off in the middle of", ""),
        id="gpt-oss-cut-off-in-analysis",
    ),
    pytest.param(
        "gpt-oss", "No harmony at all.", False, SplitReply(None, "No harmony at all."), id="gpt-oss-plain"
    ),
]


@pytest.mark.parametrize(("parser_name", "text", "prompt_opened", "expected"), CASES)
def test_split(parser_name: str, text: str, prompt_opened: bool, expected: SplitReply) -> None:
    assert reasoning_parser(parser_name).split(text, prompt_opened_reasoning=prompt_opened) == expected


def test_prompt_opened_defaults_to_false() -> None:
    assert reasoning_parser("qwen3").split("Plain.</think>Rest") == SplitReply(None, "Plain.</think>Rest")


def test_parser_names_are_sglangs() -> None:
    assert (
        frozenset({"qwen3", "qwen3-thinking", "deepseek-r1", "glm45", "kimi", "gpt-oss"})
        == REASONING_PARSER_NAMES
    )
    for name in REASONING_PARSER_NAMES:
        assert reasoning_parser(name).name == name


def test_unknown_parser_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="mistral") as raised:
        reasoning_parser("mistral")
    for name in REASONING_PARSER_NAMES:
        assert name in str(raised.value)
