"""What the model itself generates for an assistant reply, in each family's real output format.

A reply is the text the model writes after the generation prompt, up to and including the stop
token it ends on: reasoning, content, tool calls, then the family's own end-of-turn token. Tests
feed these to stand-in engines, so the proxy meets replies exactly as SGLang returns them from a
real model of the family (and parses them with the family's SGLang tool-call and reasoning parsers).

JSON is written as the templates' `tojson` writes it (json.dumps, ensure_ascii=False), so a reply
and the template's rendering of the same message agree byte for byte where the template keeps it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

ToolCalls = Sequence[tuple[str, Mapping[str, Any]]]


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _no_reasoning(family: str, reasoning: str | None) -> None:
    if reasoning is not None:
        raise ValueError(f"{family} has no reasoning format; pass reasoning=None")


def _hermes_call(name: str, arguments: Mapping[str, Any]) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {_json(arguments)}}}\n</tool_call>'


def qwen3_reply(reasoning: str | None, content: str, tool_calls: ToolCalls = ()) -> str:
    """`<think>\\n{reasoning}\\n</think>\\n\\n{content}`, hermes tool calls, `<|im_end|>`.

    reasoning=None writes no think block: that is the reply to a prompt rendered with
    enable_thinking=false, whose generation prompt already holds the closed empty block.
    """
    text = "" if reasoning is None else f"<think>\n{reasoning}\n</think>\n\n"
    text += content
    for index, (name, arguments) in enumerate(tool_calls):
        text += ("\n" if content or index else "") + _hermes_call(name, arguments)
    return text + "<|im_end|>"


def qwen25_reply(reasoning: str | None, content: str, tool_calls: ToolCalls = ()) -> str:
    """`{content}`, hermes tool calls (each on a new line after content), `<|im_end|>`."""
    _no_reasoning("qwen25", reasoning)
    calls = "\n".join(_hermes_call(name, arguments) for name, arguments in tool_calls)
    return content + ("\n" if content and calls else "") + calls + "<|im_end|>"


def llama31_reply(reasoning: str | None, content: str, tool_calls: ToolCalls = ()) -> str:
    """`{content}<|eot_id|>`, or one JSON tool call `{"name": ..., "parameters": {...}}<|eot_id|>`.

    Llama 3.1 calls one tool per turn and writes nothing beside the call (the template renders a
    tool-call turn as the call alone, and SGLang's llama3 parser takes a reply as a call only when
    it starts with the JSON), so content with a call, or several calls, are refused.
    """
    _no_reasoning("llama31", reasoning)
    if not tool_calls:
        return content + "<|eot_id|>"
    if len(tool_calls) != 1 or content:
        raise ValueError("llama31 replies hold either content or exactly one tool call")
    name, arguments = tool_calls[0]
    return f'{{"name": "{name}", "parameters": {_json(arguments)}}}<|eot_id|>'


def deepseek_r1_reply(reasoning: str | None, content: str, tool_calls: ToolCalls = ()) -> str:
    """`{reasoning}\\n</think>\\n\\n{content}`, DeepSeek's tool-call block, `<｜end▁of▁sentence｜>`.

    The generation prompt opened the think block (`<｜Assistant｜><think>\\n`), so the reply starts
    inside it and always closes it; reasoning=None is an empty think block.
    """
    text = f"{reasoning or ''}\n</think>\n\n{content}"
    if tool_calls:
        calls = "\n".join(
            f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{_json(arguments)}\n```<｜tool▁call▁end｜>"
            for name, arguments in tool_calls
        )
        text += f"<｜tool▁calls▁begin｜>{calls}<｜tool▁calls▁end｜>"
    return text + "<｜end▁of▁sentence｜>"


def glm45_reply(reasoning: str | None, content: str, tool_calls: ToolCalls = ()) -> str:
    """`\\n<think>{reasoning}</think>`, `\\n{content}`, XML tool calls, then the stop token the model
    generates to end its turn: `<|observation|>` after tool calls, `<|user|>` otherwise.

    reasoning=None writes no think block: the reply to a prompt rendered with enable_thinking=false,
    whose generation prompt already holds `\\n<think></think>`.
    """
    text = "" if reasoning is None else f"\n<think>{reasoning}</think>"
    if content:
        text += f"\n{content}"
    for name, arguments in tool_calls:
        text += f"\n<tool_call>{name}\n"
        for key, value in arguments.items():
            rendered = value if isinstance(value, str) else _json(value)
            text += f"<arg_key>{key}</arg_key>\n<arg_value>{rendered}</arg_value>\n"
        text += "</tool_call>"
    return text + ("<|observation|>" if tool_calls else "<|user|>")


def qwen3_vl_reply(reasoning: str | None, content: str, tool_calls: ToolCalls = ()) -> str:
    """Qwen3-VL Instruct: Qwen3's format without reasoning (the Instruct models do not think)."""
    _no_reasoning("qwen3_vl", reasoning)
    return qwen3_reply(None, content, tool_calls)


def gpt_oss_reply(reasoning: str | None, content: str, tool_calls: ToolCalls = ()) -> str:
    """Harmony messages after the generation prompt's `<|start|>assistant`: the reasoning as an analysis
    message, then either the final answer ending on `<|return|>` or one tool call ending on `<|call|>`,
    addressed as gpt-oss writes it (`<|channel|>commentary to=functions.NAME <|constrain|>json`).

    A harmony message holds one call, and the model stops at it, so content beside a call (a preamble)
    and several calls are refused here; reasoning=None writes no analysis message.
    """
    text = "" if reasoning is None else f"<|channel|>analysis<|message|>{reasoning}<|end|><|start|>assistant"
    if not tool_calls:
        return f"{text}<|channel|>final<|message|>{content}<|return|>"
    if len(tool_calls) != 1 or content:
        raise ValueError("gpt_oss replies hold either content or exactly one tool call")
    name, arguments = tool_calls[0]
    header = f"<|channel|>commentary to=functions.{name} <|constrain|>json"
    return f"{text}{header}<|message|>{_json(arguments)}<|call|>"


def kimi_k2_reply(reasoning: str | None, content: str, tool_calls: ToolCalls = ()) -> str:
    """`{content}`, then Kimi's tool-call section (ids `functions.NAME:IDX`, the index counting the reply's
    calls from 0, the arguments as JSON), `<|im_end|>`. K2 Instruct has no reasoning format."""
    _no_reasoning("kimi_k2", reasoning)
    if not tool_calls:
        return content + "<|im_end|>"
    calls = "".join(
        f"<|tool_call_begin|>functions.{name}:{index}<|tool_call_argument_begin|>{_json(arguments)}<|tool_call_end|>"
        for index, (name, arguments) in enumerate(tool_calls)
    )
    return f"{content}<|tool_calls_section_begin|>{calls}<|tool_calls_section_end|><|im_end|>"
