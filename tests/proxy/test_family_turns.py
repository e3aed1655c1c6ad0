"""Multi-turn, tool-using sessions through the proxy with the real or rebuilt vocabularies and the chat
templates of seven model families, driven by the official openai client.

The upstream is the scripted stand-in (`rolloutfleet_testkit.scripted_upstream`): it answers with
replies written in each family's real output format (reasoning, tool calls, stop token), because no
model here writes them. The recorded ids are checked against a reference computed here
independently of the proxy's method: the model's output ids kept as generated, and for every other
span what the family's template renders there in the REAL conversation (the whole history, rendered
once per turn), cut after the last reply using the family's known closing text.
"""

from __future__ import annotations

import json

import pytest
from family_reference import span_after_reply, template_messages
from openai import OpenAI
from proxy_harness import running_proxy
from rolloutfleet_testkit.model_families import FAMILIES, ModelFamily
from rolloutfleet_testkit.processes import serve_app
from rolloutfleet_testkit.scripted_upstream import ScriptedUpstream, reply_logprobs
from transformers import AutoTokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    },
]


def conversation(family: ModelFamily) -> list[tuple[list[dict], tuple]]:
    """Six turns: (new client messages before the turn, the model's reply as (reasoning, content, calls)).
    Tool results are filled in with the ids the proxy returned (None here)."""
    thinks = family.reasoning_parser is not None

    def r(text: str) -> str | None:
        return text if thinks else None

    return [
        (
            [
                {"role": "system", "content": "You are a careful assistant. Use tools when useful."},
                {"role": "user", "content": "What is the weather in Paris? Answer in °C, s'il vous plaît."},
            ],
            (r("The user wants Paris weather; call get_weather."), "", [("get_weather", {"city": "Paris"})]),
        ),
        (
            [{"role": "tool", "content": '{"temp": 21, "sky": "clear"}'}],
            (r("21 degrees and clear."), "It is 21 °C and clear in Paris.", []),
        ),
        (
            [{"role": "user", "content": "What is 17 * 23?"}],
            (r("Use the calculator."), "", [("calculator", {"expression": "17 * 23"})]),
        ),
        (
            [{"role": "tool", "content": "391"}],
            (r("The tool says 391."), "17 * 23 = 391.", []),
        ),
        (
            [{"role": "user", "content": "And the weather in Tokyo, in Fahrenheit?"}],
            (
                r("Call get_weather for Tokyo with unit f."),
                "",
                [("get_weather", {"city": "東京", "unit": "f"})],
            ),
        ),
        (
            [{"role": "tool", "content": '{"temp": 64, "sky": "rain"}'}],
            (r("64 F and raining."), "Tokyo: 64 °F with rain. 🌧", []),
        ),
    ]


def stop_ids(tokenizer, family: ModelFamily) -> list[int]:
    return [tokenizer.convert_tokens_to_ids(t) for t in family.stop_tokens]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request) -> ModelFamily:
    return FAMILIES[request.param]


@pytest.fixture(scope="module")
def family_tokenizer(family):
    directory = family.build_cached()
    return directory, AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def test_tool_conversation_is_token_exact(family, family_tokenizer, tmp_path):
    directory, tokenizer = family_tokenizer
    upstream = ScriptedUpstream(
        lambda ids: tokenizer.decode(ids, skip_special_tokens=True), stop_ids(tokenizer, family)
    )
    with (
        serve_app(upstream) as upstream_url,
        running_proxy(
            upstream_url,
            directory,
            tmp_path / "dumps",
            tool_call_parser=family.tool_call_parser,
            reasoning_parser=family.reasoning_parser,
        ) as proxy,
    ):
        sid, key = proxy.create_session()
        client = OpenAI(base_url=f"{proxy.url}/v1/sessions/{sid}", api_key=key, max_retries=0)
        messages: list[dict] = []
        expected: list[int] = []
        outputs: list[list[int]] = []
        last_calls: list[dict] = []
        last_stop_text = ""
        for turn, (new_messages, (reasoning, content, calls)) in enumerate(conversation(family)):
            for message in new_messages:
                if message["role"] == "tool":  # answers the call the proxy returned last turn
                    message = {**message, "tool_call_id": last_calls[0]["id"]}
                messages.append(message)
            reply_text = family.model_reply_text(reasoning, content, calls)
            output_ids = tokenizer.encode(reply_text, add_special_tokens=False)
            upstream.script(output_ids)
            if turn == 0:
                expected += tokenizer.apply_chat_template(
                    template_messages(messages), tools=TOOLS, tokenize=True, add_generation_prompt=True
                )["input_ids"]
            else:
                last_reply = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
                expected += span_after_reply(tokenizer, family, messages, last_reply, TOOLS, last_stop_text)
            response = client.chat.completions.create(
                model="m", messages=messages, tools=TOOLS, max_tokens=256, temperature=1.0
            )
            assert upstream.prompts[-1] == expected, f"turn {turn}: the prompt sent upstream differs"
            expected += output_ids
            outputs.append(output_ids)
            choice = response.choices[0]
            message = choice.message
            got_calls = [
                (c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or ()
            ]
            assert got_calls == [(name, args) for name, args in calls], f"turn {turn}"
            assert choice.finish_reason == ("tool_calls" if calls else "stop")
            assert (message.content or "").strip() == content
            if family.reasoning_parser is not None:
                assert message.model_extra["reasoning_content"].strip() == reasoning
            last_calls = [c.model_dump() for c in message.tool_calls or ()]
            last_stop_text = tokenizer.convert_ids_to_tokens(output_ids[-1])
            messages.append(message.model_dump(exclude_none=True))

        trajectory = proxy.get(sid, key).json()["trajectory"]
        assert trajectory["input_ids"] == expected
        mask = trajectory["loss_mask"]
        generated = [i for i, m in enumerate(mask) if m == 1]
        assert len(generated) == sum(len(o) for o in outputs)
        for start, output_start, end in trajectory["turns"]:
            assert mask[start:output_start] == [0] * (output_start - start)
            assert mask[output_start:end] == [1] * (end - output_start)
            assert trajectory["logprobs"][output_start:end] == pytest.approx(
                reply_logprobs(end - output_start)
            )
