"""The OpenAI Responses dialect (`openai_responses.py`): input items as their chat equivalent,
`previous_response_id` resolved from the session's tree, the answer and its event stream as the
official `openai` client reads them, and refusals that leave the session as it was. Against the SGLang
emulator."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from proxy_harness import ADMIN, bearer, running_proxy
from rolloutfleet_proxy.history import canonical_message
from rolloutfleet_proxy.openai_responses import chat_messages

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def canonical(messages: list[dict]) -> list[dict]:
    """Messages as the chat request holds them (text parts joined, arguments as objects)."""
    return [canonical_message(m) for m in messages]


def test_input_items_are_their_chat_equivalent():
    body = {
        "instructions": "Be brief.",
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Weather "},
                    {"type": "input_text", "text": "in Paris and Rome?"},
                ],
            },
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [{"type": "summary_text", "text": "ignored"}],
                "content": [{"type": "reasoning_text", "text": "Two calls."}],
            },
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
            },
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "get_weather",
                "arguments": '{"city": "Paris"}',
            },
            {
                "type": "function_call",
                "call_id": "c2",
                "name": "get_weather",
                "arguments": '{"city": "Rome"}',
            },
            {"type": "function_call_output", "call_id": "c1", "output": "21 C"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "down"}],
            },
            {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "Summed up."}]},
            {"type": "function_call", "call_id": "c3", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c3", "output": "?"},
            {"role": "user", "content": "Thanks"},
        ],
    }
    calls = [
        {
            "id": "c1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        },
        {
            "id": "c2",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
        },
    ]
    assert canonical(chat_messages(body, after_previous=False)) == canonical(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {
                "role": "assistant",
                "content": "Checking.",
                "reasoning_content": "Two calls.",
                "tool_calls": calls,
            },
            {"role": "tool", "tool_call_id": "c1", "content": "21 C"},
            {"role": "tool", "tool_call_id": "c2", "content": "down"},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "Summed up.",
                "tool_calls": [
                    {"id": "c3", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c3", "content": "?"},
            {"role": "user", "content": "Thanks"},
        ]
    )
    # After a previous response: no instructions (its turn holds them), and outputs that open the input
    # answer its calls (checked by the turn, against its recorded reply).
    follow_up = {
        "instructions": "Be brief.",
        "input": [{"type": "function_call_output", "call_id": "cX", "output": "1"}],
    }
    assert canonical(chat_messages(follow_up, after_previous=True)) == [
        {"role": "tool", "tool_call_id": "cX", "content": "1"}
    ]


@pytest.fixture
def proxy(sglang_emulator_url, test_tokenizer_dir, tmp_path):
    with running_proxy(
        sglang_emulator_url, test_tokenizer_dir, tmp_path / "dumps", tool_call_parser="qwen25"
    ) as running:
        yield running


def test_previous_response_id_continues_the_named_turn_and_a_bad_one_changes_nothing(proxy):
    sid, key = proxy.create_session()
    client = openai.OpenAI(base_url=f"{proxy.url}/v1/sessions/{sid}", api_key=key, max_retries=0).responses
    first = client.create(
        model="m", instructions="Be brief.", input="Hello there", max_output_tokens=4, tools=[WEATHER]
    )
    assert first.id == f"resp_{sid}_0" and first.output[-1].type in ("message", "function_call")
    second = client.create(
        model="m", previous_response_id=first.id, input="And then?", max_output_tokens=4, tools=[WEATHER]
    )
    third = client.create(
        model="m", previous_response_id=first.id, input="Something else", max_output_tokens=4, tools=[WEATHER]
    )
    summary = proxy.get(sid, key).json()
    # Both continue turn 0: two branches, each turn's prompt is turn 0's path plus its own new input.
    assert (second.id, third.id) == (f"resp_{sid}_1", f"resp_{sid}_2")
    assert summary["num_turns"] == 3 and summary["num_branches"] == 2
    # The alias under the API root's path is the same route: the second request again is a replay.
    alias = httpx.post(
        f"{proxy.url}/v1/sessions/{sid}/v1/responses",
        headers=bearer(key),
        json={
            "model": "m",
            "previous_response_id": first.id,
            "input": "And then?",
            "max_output_tokens": 4,
            "tools": [WEATHER],
        },
    )
    assert alias.status_code == 200 and alias.headers["Idempotent-Replayed"] == "true"
    assert alias.json()["id"] == second.id
    # The same conversation sent whole (as its chat equivalent) is the recorded one: a replay.
    reply = first.output[-1]
    assert reply.type == "message"  # the emulator's model writes no tool call
    assistant = {"role": "assistant", "content": reply.content[0].text}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello there"},
        assistant,
        {"role": "user", "content": "And then?"},
    ]
    chat_tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    whole = httpx.post(
        f"{proxy.url}/v1/sessions/{sid}/chat/completions",
        headers=bearer(key),
        json={"messages": messages, "max_tokens": 4, "tools": chat_tools},
    )
    assert whole.status_code == 200 and whole.headers["Idempotent-Replayed"] == "true"
    assert whole.json()["rolloutfleet"]["turn"] == 1

    recorded = proxy.get(sid, key).json()
    refusals = [
        ({"previous_response_id": f"resp_{sid}_99", "input": "x"}, "previous_response_not_found"),
        ({"previous_response_id": "resp_other-session_0", "input": "x"}, "previous_response_not_found"),
        ({"previous_response_id": "garbage", "input": "x"}, "previous_response_not_found"),
        (
            {
                "previous_response_id": first.id,
                "input": [{"type": "function_call_output", "call_id": "call_never", "output": "1"}],
            },
            "unknown_tool_call_id",
        ),
        (
            {"input": [{"type": "function_call_output", "call_id": "call_never", "output": "1"}]},
            "unknown_tool_call_id",
        ),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "unsupported_parameter"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "unsupported_content"),
        ({"input": []}, "invalid_messages"),
    ]
    for body, code in refusals:
        with pytest.raises(openai.BadRequestError) as refused:
            client.create(model="m", max_output_tokens=4, **body)
        assert refused.value.code == code, (body, refused.value.body)
    assert proxy.get(sid, key).json() == recorded  # nothing recorded, nothing changed


def test_a_streamed_response_that_runs_out_of_tokens_is_incomplete(proxy):
    created = httpx.post(f"{proxy.url}/v1/sessions", headers=ADMIN, json={}).json()
    # From the capability URL alone, as agent harnesses get only a base URL.
    client = openai.OpenAI(
        base_url=proxy.url + created["capability_url"], api_key="EMPTY", max_retries=0
    ).responses
    events = list(client.create(model="m", input="Tell me a long story.", max_output_tokens=3, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    final = events[-1].response
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    if final.usage.output_tokens == 3:  # the emulator's model may end early on its end token
        assert kinds[-1] == "response.incomplete" and final.status == "incomplete"
        assert final.incomplete_details.reason == "max_output_tokens"
    else:
        assert kinds[-1] == "response.completed" and final.status == "completed"
    assert final.output[-1].content[0].text == text
    again = client.create(model="m", input="Tell me a long story.", max_output_tokens=3)
    assert again.id == final.id and again.output_text == text  # a retry: the recorded answer
    assert json.loads(again.to_json())["rolloutfleet"]["turn"] == 0
