"""Tools, tool_choice and template keywords in requests: validation (400 and state intact), the reply's
tool calls in JSON and SSE, and templates the proxy must refuse at start-up."""

from __future__ import annotations

import json
import shutil

import httpx
import orjson
import pytest
from proxy_harness import running_proxy
from rolloutfleet_proxy.chat_tokens import TemplateError, TurnTokenizer
from rolloutfleet_proxy.chat_tools import check_tool_results, parse_tools, template_kwargs
from rolloutfleet_proxy.errors import ProxyError
from rolloutfleet_proxy.history import InvalidMessage, canonical_message, extend_digest, tools_digest
from rolloutfleet_testkit.model_families import FAMILIES
from rolloutfleet_testkit.processes import serve_app
from rolloutfleet_testkit.scripted_upstream import ScriptedUpstream
from test_proxy_restart import proxy_exit
from transformers import AutoTokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def error_code(call) -> str:
    with pytest.raises(ProxyError) as caught:
        call()
    assert caught.value.status == 400
    return caught.value.code


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"tools": {"not": "a list"}}, "invalid_tools"),
        ({"tools": [{"type": "retrieval"}]}, "invalid_tools"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "invalid_tools"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
            "invalid_tools",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            "invalid_tools",
        ),
        ({"tools": [WEATHER, WEATHER]}, "invalid_tools"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "invalid_tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "invalid_tool_choice",
        ),
        ({"tools": [WEATHER], "tool_choice": 5}, "invalid_tool_choice"),
        ({"tool_choice": "required"}, "invalid_tool_choice"),
    ],
)
def test_bad_tools_are_400(body, code):
    assert error_code(lambda: parse_tools(body)) == code


def test_tools_and_choice_parsed():
    spec = parse_tools(
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    )
    assert spec is not None and spec.names == {"get_weather"} and spec.forced_name == "get_weather"
    assert spec.rendered == [WEATHER]
    none = parse_tools({"tools": [WEATHER], "tool_choice": "none"})
    assert none is not None and none.rendered is None and not none.parse_calls
    assert parse_tools({}) is None


def test_tool_results_must_answer_the_last_calls():
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    history = [
        canonical_message({"role": "user", "content": "q"}),
        canonical_message({"role": "assistant", "content": None, "tool_calls": [call]}),
        canonical_message({"role": "tool", "tool_call_id": "call_1", "content": "r"}),
    ]
    check_tool_results(history)
    wrong = [*history[:2], canonical_message({"role": "tool", "tool_call_id": "call_9", "content": "r"})]
    assert error_code(lambda: check_tool_results(wrong)) == "unknown_tool_call_id"


@pytest.mark.parametrize(
    "message",
    [
        {
            "role": "assistant",
            "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{not json"}}],
        },
        {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "[1]"}}]},
        {
            "role": "assistant",
            "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "[" * 100 + "]" * 100}}],
        },
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
        {"role": "user", "content": "x", "tool_calls": [{"id": "c", "function": {"name": "f"}}]},
        {"role": "tool", "content": "no call id"},
        {"role": ["user"], "content": "unhashable role"},
    ],
)
def test_bad_tool_messages_are_invalid(message):
    with pytest.raises(InvalidMessage):
        canonical_message(message)


def test_digest_ignores_argument_spacing_and_reasoning_but_not_tools():
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1, "b": 2}'}}
    spaced = {**call, "function": {"name": "f", "arguments": '{"b":2,"a":1}'}}
    a = {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "think"}
    b = {"role": "assistant", "content": "", "tool_calls": [spaced]}
    assert extend_digest(b"\0" * 32, [a]) == extend_digest(b"\0" * 32, [b])
    assert tools_digest(None) == b"\0" * 32
    assert tools_digest([WEATHER]) != tools_digest(None)


def test_template_kwargs_merge_and_reserved_names():
    assert template_kwargs({"chat_template_kwargs": {"a": 2}}, {"a": 1, "b": 1}) == {"a": 2, "b": 1}
    assert (
        error_code(lambda: template_kwargs({"chat_template_kwargs": {"tokenize": True}}, {}))
        == "invalid_parameter"
    )
    assert error_code(lambda: template_kwargs({"chat_template_kwargs": [1]}, {})) == "invalid_parameter"


def test_reasoning_effort_is_a_template_keyword_below_the_requests_own():
    defaults = {"reasoning_effort": "medium", "a": 1}
    assert template_kwargs({"reasoning_effort": "high"}, defaults) == {"reasoning_effort": "high", "a": 1}
    both = {"reasoning_effort": "high", "chat_template_kwargs": {"reasoning_effort": "low"}}
    assert template_kwargs(both, defaults) == {"reasoning_effort": "low", "a": 1}
    assert template_kwargs({}, {}) == {}
    for bad in ("extreme", 3, ["low"]):
        assert (
            error_code(lambda bad=bad: template_kwargs({"reasoning_effort": bad}, {})) == "invalid_parameter"
        )


# --- start-up refusals ------------------------------------------------------------------------------


def tokenizer_with_template(source, target, template: str):
    shutil.copytree(source, target)
    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config))
    (target / "chat_template.jinja").unlink(missing_ok=True)
    return target


# Numbers every message: what it renders after a reply depends on the history before it.
NUMBERING = (
    "{% for m in messages %}<|im_start|>{{ loop.index }} {{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_history_dependent_template_is_refused(test_tokenizer_dir, tmp_path):
    directory = tokenizer_with_template(test_tokenizer_dir, tmp_path / "tok", NUMBERING)
    with pytest.raises(TemplateError, match="differently depending on the conversation before it"):
        TurnTokenizer(AutoTokenizer.from_pretrained(str(directory)))


def test_proxy_refuses_to_start_with_such_a_template(test_tokenizer_dir, tmp_path):
    directory = tokenizer_with_template(test_tokenizer_dir, tmp_path / "tok", NUMBERING)
    code, log = proxy_exit(tmp_path, directory, "--dump-dir", str(tmp_path / "d"))
    assert code == 3
    assert "differently depending on the conversation before it" in log


# A tool result needs the tool call before it (as in gpt-oss's template), so it cannot follow a reply
# known only by its text; and unlike gpt-oss's, the template does not end a call with a stop token, so
# the ids of the call's own rendering cannot be told apart from what follows: refused.
NEEDS_THE_CALL = (
    "{% set ns = namespace(call=none) %}{% for m in messages %}"
    "{% if m['role'] == 'assistant' and m.get('tool_calls') %}"
    "{% set ns.call = m['tool_calls'][0] %}{% endif %}"
    "{% if m['role'] == 'tool' and ns.call is none %}{{ raise_exception('tool result without a tool call') }}"
    "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_needs_the_call_is_refused_only_with_a_tool_call_parser(test_tokenizer_dir, tmp_path):
    directory = tokenizer_with_template(test_tokenizer_dir, tmp_path / "tok", NEEDS_THE_CALL)
    hf = AutoTokenizer.from_pretrained(str(directory))
    TurnTokenizer(hf)  # plain chat works
    with pytest.raises(TemplateError, match="cannot render a tool result after an assistant reply"):
        TurnTokenizer(hf, tool_results=True)


def test_a_call_ended_on_a_stop_token_is_rendered_before_its_tool_result():
    """gpt-oss's template names the called function in a tool result's header and ends a call with
    <|call|>: the result is rendered after the reply's real call, from <|call|> on."""
    directory = FAMILIES["gpt_oss"].build_cached()
    turns = TurnTokenizer.from_path(str(directory), tool_results=True)
    call_end = turns.hf_tokenizer.convert_tokens_to_ids("<|call|>")
    assert turns.call_closer_id == call_end
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
    }
    reply = {"role": "assistant", "content": None, "tool_calls": [call]}
    result = [{"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    stopped, text = turns.continuation(result, call_end, [WEATHER], None, reply=reply)
    assert text == (
        '<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>'
        "<|start|>assistant"
    )
    assert turns.decode(stopped, skip_special_tokens=False) == text.removeprefix("<|call|>")
    cut_off, _ = turns.continuation(result, None, [WEATHER], None, reply=reply)  # no stop token: closed here
    assert list(cut_off) == [call_end, *stopped]
    # A user message after a call needs no call: the reply's closer stands in, as for any reply.
    user, _ = turns.continuation([{"role": "user", "content": "Hi"}], call_end, [WEATHER], None, reply=reply)
    assert (
        turns.decode(user, skip_special_tokens=False) == "<|start|>user<|message|>Hi<|end|><|start|>assistant"
    )
    with pytest.raises(Exception, match="needs an assistant tool call"):  # the template's own refusal
        turns.continuation(result, call_end, [WEATHER], None, reply={"role": "assistant", "content": "Hi"})


def test_a_template_whose_call_changes_when_a_result_follows_is_refused(tmp_path):
    source = FAMILIES["gpt_oss"].build_cached()
    changing = FAMILIES["gpt_oss"].chat_template.replace(
        "{{- call.arguments | tojson + '<|call|>' -}}",
        "{{- call.arguments | tojson + ('<|call|>' if loop.last else '<|end|>') -}}",
    )
    assert changing != FAMILIES["gpt_oss"].chat_template
    directory = tokenizer_with_template(source, tmp_path / "tok", changing)
    hf = AutoTokenizer.from_pretrained(str(directory))
    TurnTokenizer(hf)  # plain chat works
    with pytest.raises(TemplateError, match="cannot render a tool result after an assistant reply"):
        TurnTokenizer(hf, tool_results=True)


def test_unknown_parser_names_refuse_to_start(test_tokenizer_dir, tmp_path):
    code, log = proxy_exit(
        tmp_path, test_tokenizer_dir, "--dump-dir", str(tmp_path / "d"), "--tool-call-parser", "hermes2"
    )
    assert code == 2
    assert "qwen25" in log  # the message names the known parsers
    code, log = proxy_exit(
        tmp_path, test_tokenizer_dir, "--dump-dir", str(tmp_path / "d"), "--reasoning-parser", "r1"
    )
    assert code == 2
    assert "deepseek-r1" in log


# --- through a running proxy ------------------------------------------------------------------------


@pytest.fixture
def scripted(test_tokenizer_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(str(test_tokenizer_dir))
    upstream = ScriptedUpstream(
        lambda ids: tokenizer.decode(ids, skip_special_tokens=True), [tokenizer.eos_token_id]
    )
    with (
        serve_app(upstream) as url,
        running_proxy(url, test_tokenizer_dir, tmp_path / "dumps", tool_call_parser="qwen25") as proxy,
    ):
        yield proxy, upstream, tokenizer


def hermes_reply(tokenizer, name: str, arguments: dict) -> list[int]:
    text = f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call><|im_end|>'
    return tokenizer.encode(text, add_special_tokens=False)


def test_bad_tool_input_leaves_the_session_intact(scripted):
    proxy, upstream, tokenizer = scripted
    sid, key = proxy.create_session()
    url = f"{proxy.url}/v1/sessions/{sid}/chat/completions"
    auth = {"Authorization": f"Bearer {key}"}
    upstream.script(hermes_reply(tokenizer, "get_weather", {"city": "Paris"}))
    messages = [{"role": "user", "content": "weather?"}]
    first = httpx.post(url, headers=auth, json={"messages": messages, "tools": [WEATHER]})
    assert first.status_code == 200, first.text
    reply = first.json()["choices"][0]
    assert reply["finish_reason"] == "tool_calls"
    call = reply["message"]["tool_calls"][0]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    messages.append(reply["message"])
    before = proxy.get(sid, key).json()
    bad_requests = [
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
            "invalid_tools",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "invalid_tool_choice",
        ),
        (
            {
                "tools": [WEATHER],
                "messages": [*messages, {"role": "tool", "tool_call_id": "call_x", "content": "1"}],
            },
            "unknown_tool_call_id",
        ),
        (
            {
                "tools": [WEATHER],
                "messages": [
                    messages[0],
                    {
                        **messages[1],
                        "tool_calls": [{**call, "function": {"name": "get_weather", "arguments": "{oops"}}],
                    },
                    {"role": "tool", "tool_call_id": call["id"], "content": "1"},
                ],
            },
            "invalid_messages",
        ),
    ]
    for extra, code in bad_requests:
        body = {
            "messages": [*messages, {"role": "tool", "tool_call_id": call["id"], "content": "1"}],
            **extra,
        }
        response = httpx.post(url, headers=auth, json=body)
        assert 400 <= response.status_code < 500, response.text
        assert response.json()["error"]["code"] == code, response.text
    assert proxy.get(sid, key).json() == before
    upstream.script(tokenizer.encode("It is sunny.<|im_end|>", add_special_tokens=False))
    messages.append({"role": "tool", "tool_call_id": call["id"], "content": "sunny"})
    ok = httpx.post(url, headers=auth, json={"messages": messages, "tools": [WEATHER]})
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["message"] == {"role": "assistant", "content": "It is sunny."}


def test_malformed_tool_call_is_content_and_recorded_exactly(scripted):
    proxy, upstream, tokenizer = scripted
    sid, key = proxy.create_session()
    broken = tokenizer.encode(
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call><|im_end|>',
        add_special_tokens=False,
    )
    upstream.script(broken)
    response = httpx.post(
        f"{proxy.url}/v1/sessions/{sid}/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"messages": [{"role": "user", "content": "w?"}], "tools": [WEATHER]},
    )
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert "tool_calls" not in choice["message"]
    assert choice["message"]["content"].startswith("<tool_call>")
    trajectory = proxy.get(sid, key).json()["trajectory"]
    _, output_start, end = trajectory["turns"][0]
    assert trajectory["input_ids"][output_start:end] == broken


def test_tool_calls_stream_as_sse(scripted):
    proxy, upstream, tokenizer = scripted
    sid, key = proxy.create_session()
    upstream.script(hermes_reply(tokenizer, "get_weather", {"city": "Oslo"}))
    with httpx.stream(
        "POST",
        f"{proxy.url}/v1/sessions/{sid}/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"messages": [{"role": "user", "content": "w?"}], "tools": [WEATHER], "stream": True},
    ) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [orjson.loads(line[6:]) for line in lines[:-1]]
    calls = [
        c for chunk in chunks for choice in chunk["choices"] for c in choice["delta"].get("tool_calls", ())
    ]
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (0, "get_weather", {"city": "Oslo"})
    ]
    assert calls[0]["id"].startswith("call_")
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_tools_without_a_parser_are_refused(test_tokenizer_dir, tmp_path):
    upstream = ScriptedUpstream(lambda ids: "", [])
    with serve_app(upstream) as url, running_proxy(url, test_tokenizer_dir, tmp_path / "d") as proxy:
        sid, key = proxy.create_session()
        response = httpx.post(
            f"{proxy.url}/v1/sessions/{sid}/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"messages": [{"role": "user", "content": "w?"}], "tools": [WEATHER]},
        )
        assert response.status_code == 400
        assert "toolCallParser" in response.json()["error"]["message"]
        assert upstream.prompts == []


def test_special_tokens_left_in_a_parsed_reply_are_removed_like_sglang_decoding(scripted):
    proxy, upstream, tokenizer = scripted
    sid, key = proxy.create_session()
    reply = tokenizer.encode("Hi<|endoftext|> there<|im_end|>", add_special_tokens=False)
    upstream.script(reply)
    response = httpx.post(
        f"{proxy.url}/v1/sessions/{sid}/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"messages": [{"role": "user", "content": "w?"}], "tools": [WEATHER]},
    )
    assert response.json()["choices"][0]["message"]["content"] == "Hi there"
    _, output_start, end = proxy.get(sid, key).json()["trajectory"]["turns"][0]
    assert proxy.get(sid, key).json()["trajectory"]["input_ids"][output_start:end] == reply
