"""One session spoken in three dialects at once, with the official clients, through the real
sglang-router: Anthropic's `messages` (streaming and not), openai's `responses` (streaming and not,
with and without `previous_response_id`) and chat completions, in the six-turn tool conversation of
`test_family_turns.py` (thinking where the family has it), for its five model families (real
vocabularies and templates: Qwen3, Qwen2.5, Llama 3.1, DeepSeek-R1, GLM-4.5).

Every turn lands in the same session tree, token-exact: the prompt sent upstream is checked against a
reference computed independently of the proxy (the family's template applied by transformers to the
equivalent chat conversation, `family_reference`). Each dialect's request is built here from that
chat conversation by this test's own conversion, written from the APIs' shapes, so the proxy's
mapping is checked in reverse. The upstream is the scripted stand-in answering in the family's real
output format (no model here writes tool calls), registered with the router as a worker.
"""

from __future__ import annotations

import json

import pytest
from anthropic import Anthropic
from family_reference import span_after_reply, template_messages
from openai import OpenAI
from proxy_harness import running_proxy
from rolloutfleet_testkit.model_families import FAMILIES
from rolloutfleet_testkit.processes import serve_app
from rolloutfleet_testkit.routed_engines import router_before
from rolloutfleet_testkit.scripted_upstream import ScriptedUpstream, reply_logprobs
from test_family_turns import TOOLS, conversation, stop_ids
from transformers import AutoTokenizer

# Which dialect drives each turn of the conversation (and how): every dialect meets every other's
# history, and each streams at least once.
TURN_DIALECTS = [
    ("messages", {"stream": False}),
    ("responses", {"stream": True}),
    ("responses", {"stream": True, "previous": True}),
    ("messages", {"stream": True}),
    ("chat", {}),
    ("responses", {"stream": False}),
]


def anthropic_request(messages: list[dict]) -> dict:
    """A chat conversation as Anthropic Messages: system apart, tool results as user tool_result
    blocks, assistant turns as thinking / text / tool_use blocks."""
    system = [m["content"] for m in messages if m["role"] == "system"]
    out: list[dict] = []
    for message in messages:
        role = message["role"]
        if role == "user":
            out.append({"role": "user", "content": message["content"]})
        elif role == "tool":
            block = {
                "type": "tool_result",
                "tool_use_id": message["tool_call_id"],
                "content": message["content"],
            }
            if out and out[-1]["role"] == "user" and isinstance(out[-1]["content"], list):
                out[-1]["content"].append(block)
            else:
                out.append({"role": "user", "content": [block]})
        elif role == "assistant":
            blocks = []
            if message.get("reasoning_content"):
                blocks.append(
                    {"type": "thinking", "thinking": message["reasoning_content"], "signature": "sig"}
                )
            if message.get("content"):
                blocks.append({"type": "text", "text": message["content"]})
            for call in message.get("tool_calls") or ():
                function = call["function"]
                blocks.append(
                    {
                        "type": "tool_use",
                        "id": call["id"],
                        "name": function["name"],
                        "input": json.loads(function["arguments"]),
                    }
                )
            out.append({"role": "assistant", "content": blocks})
    return {"system": system[0] if system else None, "messages": out}


def responses_input(messages: list[dict]) -> list[dict]:
    """A chat conversation as Responses input items."""
    items: list[dict] = []
    for message in messages:
        role = message["role"]
        if role in ("user", "system"):
            items.append({"role": role, "content": message["content"]})
        elif role == "tool":
            items.append(
                {
                    "type": "function_call_output",
                    "call_id": message["tool_call_id"],
                    "output": message["content"],
                }
            )
        else:
            if message.get("reasoning_content"):
                items.append(
                    {
                        "type": "reasoning",
                        "id": "rs_x",
                        "summary": [],
                        "content": [{"type": "reasoning_text", "text": message["reasoning_content"]}],
                    }
                )
            if message.get("content"):
                items.append(
                    {
                        "type": "message",
                        "role": "assistant",
                        "content": [{"type": "output_text", "text": message["content"], "annotations": []}],
                    }
                )
            for call in message.get("tool_calls") or ():
                items.append(
                    {
                        "type": "function_call",
                        "call_id": call["id"],
                        "name": call["function"]["name"],
                        "arguments": call["function"]["arguments"],
                    }
                )
    return items


ANTHROPIC_TOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


def reply_message(reasoning: str | None, content: str, calls: list[tuple[str, str, dict]]) -> dict:
    """The assistant message a chat client would send back for a reply (as the proxy's chat answer
    has it: content None beside calls when empty)."""
    message: dict = {"role": "assistant", "content": content if content or not calls else None}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [
            {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
            for cid, name, args in calls
        ]
    return message


class Clients:
    def __init__(self, base_url: str, key: str):
        self.anthropic = Anthropic(base_url=base_url, api_key=key, max_retries=0)
        self.openai = OpenAI(base_url=base_url, api_key=key, max_retries=0)
        self.last_response_id: str | None = None
        self.sent_until = 0  # chat messages covered by the last response (previous_response_id)

    def turn(self, dialect: str, how: dict, messages: list[dict]):
        """One turn in `dialect`; the reply as (reasoning, content, [(call id, name, arguments)])."""
        if dialect == "messages":
            request = anthropic_request(messages)
            params = {
                "model": "m",
                "max_tokens": 256,
                "tools": ANTHROPIC_TOOLS,
                "messages": request["messages"],
            }
            if request["system"]:
                params["system"] = request["system"]
            if how.get("stream"):
                with self.anthropic.messages.stream(**params) as stream:
                    for _ in stream:
                        pass
                    message = stream.get_final_message()
            else:
                message = self.anthropic.messages.create(**params)
            reasoning = "".join(b.thinking for b in message.content if b.type == "thinking") or None
            content = "".join(b.text for b in message.content if b.type == "text")
            calls = [(b.id, b.name, b.input) for b in message.content if b.type == "tool_use"]
            assert message.stop_reason == ("tool_use" if calls else "end_turn")
            self.last_response_id = None
            return reasoning, content, calls
        if dialect == "responses":
            system = [m["content"] for m in messages if m["role"] == "system"]
            params = {"model": "m", "max_output_tokens": 256, "tools": RESPONSES_TOOLS}
            if how.get("previous"):
                assert self.last_response_id is not None
                params["previous_response_id"] = self.last_response_id
                params["input"] = responses_input(messages[self.sent_until :])
            else:
                params["instructions"] = system[0]
                params["input"] = responses_input([m for m in messages if m["role"] != "system"])
            if how.get("stream"):
                with self.openai.responses.stream(**params) as stream:
                    for _ in stream:
                        pass
                    response = stream.get_final_response()
            else:
                response = self.openai.responses.create(**params)
            assert response.status == "completed"
            reasoning = None
            content = ""
            calls = []
            for item in response.output:
                if item.type == "reasoning":
                    reasoning = "".join(c.text for c in item.content)
                elif item.type == "message":
                    content += "".join(c.text for c in item.content)
                elif item.type == "function_call":
                    calls.append((item.call_id, item.name, json.loads(item.arguments)))
            self.last_response_id = response.id
            self.sent_until = len(messages) + 1  # the reply follows
            return reasoning, content, calls
        completion = self.openai.chat.completions.create(
            model="m", messages=messages, tools=TOOLS, max_tokens=256, temperature=1.0
        )
        message = completion.choices[0].message
        calls = [(c.id, c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or ()]
        self.last_response_id = None
        return message.model_extra.get("reasoning_content"), message.content or "", calls


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    family = FAMILIES[request.param]
    directory = family.build_cached()
    return family, directory, AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


@pytest.mark.router
def test_three_dialects_share_one_token_exact_session(family, tmp_path):
    family, directory, tokenizer = family
    upstream = ScriptedUpstream(
        lambda ids: tokenizer.decode(ids, skip_special_tokens=True), stop_ids(tokenizer, family)
    )
    with (
        serve_app(upstream) as upstream_url,
        router_before([upstream_url], tmp_path) as router_url,
        running_proxy(
            router_url,
            directory,
            tmp_path / "dumps",
            tool_call_parser=family.tool_call_parser,
            reasoning_parser=family.reasoning_parser,
        ) as proxy,
    ):
        sid, key = proxy.create_session()
        clients = Clients(f"{proxy.url}/v1/sessions/{sid}", key)
        messages: list[dict] = []
        expected: list[int] = []
        outputs: list[list[int]] = []
        last_call_id = ""
        last_stop_text = ""
        for turn, ((new_messages, (reasoning, content, calls)), (dialect, how)) in enumerate(
            zip(conversation(family), TURN_DIALECTS, strict=True)
        ):
            for message in new_messages:
                if message["role"] == "tool":  # answers the call the proxy returned last turn
                    message = {**message, "tool_call_id": last_call_id}
                messages.append(message)
            output_ids = tokenizer.encode(
                family.model_reply_text(reasoning, content, calls), add_special_tokens=False
            )
            upstream.script(output_ids)
            if turn == 0:
                expected += tokenizer.apply_chat_template(
                    template_messages(messages), tools=TOOLS, tokenize=True, add_generation_prompt=True
                )["input_ids"]
            else:
                last_reply = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
                expected += span_after_reply(tokenizer, family, messages, last_reply, TOOLS, last_stop_text)
            got_reasoning, got_content, got_calls = clients.turn(dialect, how, messages)
            assert upstream.prompts[-1] == expected, (
                f"turn {turn} ({dialect}): the prompt sent upstream differs"
            )
            expected += output_ids
            outputs.append(output_ids)
            assert [(name, args) for _, name, args in got_calls] == list(calls), f"turn {turn} ({dialect})"
            assert got_content.strip() == content, f"turn {turn} ({dialect})"
            if family.reasoning_parser is not None:
                assert (got_reasoning or "").strip() == reasoning, f"turn {turn} ({dialect})"
            last_call_id = got_calls[0][0] if got_calls else ""
            last_stop_text = tokenizer.convert_ids_to_tokens(output_ids[-1])
            messages.append(reply_message(got_reasoning, got_content, got_calls))

        data = proxy.get(sid, key).json()
        assert data["num_turns"] == len(TURN_DIALECTS) and data["num_branches"] == 1
        trajectory = data["trajectory"]
        assert trajectory["input_ids"] == expected
        mask = trajectory["loss_mask"]
        assert sum(mask) == sum(len(o) for o in outputs)
        for start, output_start, end in trajectory["turns"]:
            assert mask[start:output_start] == [0] * (output_start - start)
            assert trajectory["logprobs"][output_start:end] == pytest.approx(
                reply_logprobs(end - output_start)
            )
