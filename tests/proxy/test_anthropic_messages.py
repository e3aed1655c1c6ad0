"""The Anthropic Messages dialect (`anthropic_messages.py`): its requests as their chat equivalent, its
answers and event stream as Anthropic's SDK reads them, and its refusals in Anthropic's error shape,
leaving the session as it was. Driven by the official `anthropic` client against the SGLang emulator."""

from __future__ import annotations

import anthropic
import httpx
import pytest
from proxy_harness import bearer, running_proxy
from rolloutfleet_proxy.anthropic_messages import MessagesDialect, chat_messages, message_events, stop_reason
from rolloutfleet_proxy.dialects import RequestContext
from rolloutfleet_proxy.replies import Reply

WEATHER = {
    "name": "get_weather",
    "description": "Current weather of a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
PNG = "iVBORw0KGgo="  # only carried here, never decoded


def test_a_messages_conversation_is_its_chat_equivalent():
    body = {
        "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Look: "},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
                ],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Two cities.", "signature": "opaque"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}},
                    {"type": "tool_use", "id": "t2", "name": "get_weather", "input": {"city": "Rome"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "21 C"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "t2",
                        "is_error": True,
                        "content": [{"type": "text", "text": "down"}],
                    },
                    {"type": "text", "text": "And now?"},
                ],
            },
        ],
    }
    assert chat_messages(body) == [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look: "},
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
            ],
        },
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "Two cities.",
            "tool_calls": [
                {
                    "id": "t1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                },
                {
                    "id": "t2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Rome"}},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "t1", "content": [{"type": "text", "text": "21 C"}]},
        {"role": "tool", "tool_call_id": "t2", "content": [{"type": "text", "text": "down"}]},
        {"role": "user", "content": [{"type": "text", "text": "And now?"}]},
    ]


def parsed(body: dict):
    context = RequestContext("s" * 8, 64, {"enable_thinking": True}, "qwen25", 16, None)
    return MessagesDialect().parse({"model": "m", "max_tokens": 32, **body}, context).request


def test_sampling_tool_choice_and_thinking_map_to_the_chat_meanings():
    history = [{"role": "user", "content": "hi"}]
    request = parsed(
        {"messages": history, "temperature": 0.5, "top_p": 0.9, "top_k": 20, "stop_sequences": ["END"]}
    )
    assert request.sampling_params == {
        "max_new_tokens": 32,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 20,
        "stop": ["END"],
    }
    assert request.template_kwargs == {"enable_thinking": True}  # the proxy's default
    assert parsed({"messages": history, "thinking": {"type": "disabled"}}).template_kwargs == {
        "enable_thinking": False
    }
    choices = {
        "auto": "auto",
        "any": "required",
        "none": "none",
    }
    for kind, chat in choices.items():
        request = parsed({"messages": history, "tools": [WEATHER], "tool_choice": {"type": kind}})
        assert request.tools is not None and request.tools.choice == chat
    named = parsed(
        {"messages": history, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}}
    )
    assert named.tools is not None and named.tools.forced_name == "get_weather"
    assert named.tools.tools == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": WEATHER["description"],
                "parameters": WEATHER["input_schema"],
            },
        }
    ]


@pytest.mark.parametrize(
    ("reply", "finish", "stop_string", "expected"),
    [
        (
            Reply("", None, [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]),
            "length",
            None,
            "tool_use",
        ),
        (Reply("cut"), "length", None, "max_tokens"),
        (Reply("done"), "stop", "END", "stop_sequence"),
        (Reply("done"), "stop", None, "end_turn"),
    ],
)
def test_stop_reasons(reply, finish, stop_string, expected):
    assert stop_reason(finish, stop_string, reply) == expected


def test_the_event_stream_has_anthropics_order():
    message = {
        "id": "msg_s_0",
        "type": "message",
        "role": "assistant",
        "model": "m",
        "content": [
            {"type": "thinking", "thinking": "hm", "signature": ""},
            {"type": "text", "text": "hi"},
            {"type": "tool_use", "id": "c", "name": "f", "input": {"a": 1}},
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {"input_tokens": 5, "output_tokens": 3},
        "rolloutfleet": {"session_id": "s", "turn": 0},
    }
    names = [event.split(b"\n")[0].decode() for event in message_events(message)]
    block = ["content_block_start", "content_block_delta", "content_block_stop"]
    assert names == [
        f"event: {n}"
        for n in [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",  # thinking_delta, then signature_delta
            "content_block_stop",
            *block,
            *block,
            "message_delta",
            "message_stop",
        ]
    ]


@pytest.fixture
def proxy(sglang_emulator_url, test_tokenizer_dir, tmp_path):
    with running_proxy(
        sglang_emulator_url, test_tokenizer_dir, tmp_path / "dumps", tool_call_parser="qwen25"
    ) as running:
        yield running


def test_refusals_come_in_anthropics_shape_and_leave_the_session_as_it_was(proxy):
    sid, key = proxy.create_session()
    base = f"{proxy.url}/v1/sessions/{sid}"
    client = anthropic.Anthropic(base_url=base, api_key=key, max_retries=0)
    history = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.messages.create(model="m", max_tokens=8, messages=history, tools=[WEATHER])
    assert first.id == f"msg_{sid}_0" and first.usage.input_tokens > 0
    recorded = proxy.get(sid, key).json()
    reply = {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]}
    made_up = {"type": "tool_result", "tool_use_id": "toolu_never_made", "content": "21 C"}

    refusals = [
        (
            {"messages": [*history, reply, {"role": "user", "content": "more"}]},
            "invalid_parameter",
        ),  # no max_tokens
        (
            {"max_tokens": 8, "messages": [*history, reply, {"role": "user", "content": [made_up]}]},
            "unknown_tool_call_id",
        ),
        (
            {
                "max_tokens": 8,
                "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}],
            },
            "unsupported_content",
        ),
        (
            {"max_tokens": 8, "messages": [*history, {"role": "assistant", "content": "The answer is"}]},
            "invalid_messages",
        ),
        (
            {
                "max_tokens": 8,
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
                "messages": history,
            },
            "unsupported_parameter",
        ),
        ({"max_tokens": 8, "temperature": 1.5, "messages": history}, "invalid_parameter"),
    ]
    for body, code in refusals:
        answer = httpx.post(f"{base}/v1/messages", headers={"x-api-key": key}, json={"model": "m", **body})
        assert answer.status_code == 400, answer.text
        error = answer.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
        assert error["error"]["code"] == code, error
    # The official client raises them as Anthropic's errors, the proxy's code inside.
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(
            model="m", max_tokens=8, messages=[*history, reply, {"role": "user", "content": [made_up]}]
        )
    assert refused.value.body["error"]["code"] == "unknown_tool_call_id"
    assert "toolu_never_made" in refused.value.body["error"]["message"]
    keyless = httpx.post(f"{base}/v1/messages", json={"model": "m", "max_tokens": 8, "messages": history})
    assert keyless.status_code == 401 and keyless.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as unknown:
        anthropic.Anthropic(
            base_url=f"{proxy.url}/v1/sessions/unknown-session-1", api_key=key, max_retries=0
        ).messages.create(model="m", max_tokens=8, messages=history)
    assert unknown.value.body["error"] == {
        "type": "not_found_error",
        "code": "not_found",
        "message": unknown.value.body["error"]["message"],
    }
    assert proxy.get(sid, key).json() == recorded  # nothing recorded, nothing changed

    # The conversation goes on after its recorded reply, in one branch.
    on = client.messages.create(
        model="m",
        max_tokens=8,
        tools=[WEATHER],
        messages=[*history, reply, {"role": "user", "content": "And Rome?"}],
    )
    summary = proxy.get(sid, key).json()
    assert on.id == f"msg_{sid}_1" and summary["num_turns"] == 2 and summary["num_branches"] == 1


def test_the_anthropic_client_streams_from_the_capability_url_alone(proxy):
    created = httpx.post(f"{proxy.url}/v1/sessions", headers=bearer("test-admin-key"), json={}).json()
    client = anthropic.Anthropic(
        base_url=proxy.url + created["capability_url"], api_key="EMPTY", max_retries=0
    )
    history = [{"role": "user", "content": "Tell me a story."}]
    with client.messages.stream(model="m", max_tokens=6, messages=history, stop_sequences=["zzz"]) as stream:
        events = [event.type for event in stream]
        message = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    # The emulator's model may end early on its end token; else SGLang stops at the limit.
    assert message.stop_reason == ("max_tokens" if message.usage.output_tokens == 6 else "end_turn")
    text = "".join(block.text for block in message.content if block.type == "text")
    # Sent again: the recorded answer, replayed (the same text), not a new sample.
    again = client.messages.create(model="m", max_tokens=6, messages=history, stop_sequences=["zzz"])
    assert "".join(b.text for b in again.content if b.type == "text") == text
    summary = proxy.get(created["session_id"], created["session_key"]).json()
    assert summary["num_turns"] == 1


def test_a_body_over_the_limit_is_refused_in_anthropics_shape(sglang_emulator_url, test_tokenizer_dir):
    with running_proxy(sglang_emulator_url, test_tokenizer_dir, None, max_body_bytes=2048) as small:
        sid, key = small.create_session()
        body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x" * 4096}]}
        answer = httpx.post(f"{small.url}/v1/sessions/{sid}/v1/messages", headers=bearer(key), json=body)
        assert answer.status_code == 413
        assert answer.json()["error"]["type"] == "request_too_large"
        assert answer.json()["error"]["code"] == "body_too_large"
