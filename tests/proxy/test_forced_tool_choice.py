"""`tool_choice: "required"` and a named function are enforced: the proxy sends the grammar of a call in
the family's format (tool_grammar.py) and the SGLang emulator masks every token with it, as SGLang does
with xgrammar. Seeded generations of the emulator's random model (which, unconstrained, writes text:
the auto and none tests show it) must each be a valid call of the right function with arguments valid
against the tool's JSON schema, and are checked token for token against an independent reference: the
model teacher-forced under a fresh xgrammar matcher of the grammar the engine was sent."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import jsonschema
import orjson
import pytest
from grammar_reference import masked_score, tokenizer_info
from openai import OpenAI
from proxy_harness import running_proxy
from rolloutfleet_proxy.chat_tools import parse_tools
from rolloutfleet_proxy.tool_grammar import tool_choice_grammar
from rolloutfleet_testkit.asgi import read_body
from rolloutfleet_testkit.processes import serve_app
from rolloutfleet_testkit.routed_engines import routed_emulators
from rolloutfleet_testkit.sglang_emulator.model import load_model, score
from rolloutfleet_testkit.sglang_emulator.server import create_app
from transformers import AutoTokenizer

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 12},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "enum": [1, 2, 3]},
        "alerts": {"type": "boolean"},
    },
    "required": ["city", "unit"],
}
CALCULATOR = {
    "type": "object",
    "properties": {"expression": {"type": "string", "maxLength": 24}},
    "required": ["expression"],
}
SCHEMAS = {"get_weather": WEATHER, "calculator": CALCULATOR}
TOOLS = [{"type": "function", "function": {"name": name, "parameters": s}} for name, s in SCHEMAS.items()]
NAMED = {"type": "function", "function": {"name": "calculator"}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris, and what is 17 * 23?"}]


class RecordingEngine:
    """The emulator's app, keeping every /generate body it was sent (what the proxy asked for)."""

    def __init__(self, app):
        self.app = app
        self.bodies: list[dict] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] == "/generate":
            raw = await read_body(receive)
            self.bodies.append(orjson.loads(raw))
            delivered = False

            async def replay():
                nonlocal delivered
                if delivered:
                    return await receive()
                delivered = True
                return {"type": "http.request", "body": raw, "more_body": False}

            return await self.app(scope, replay, send)
        return await self.app(scope, receive, send)


@pytest.fixture(scope="module")
def tokenizer(test_tokenizer_dir):
    return AutoTokenizer.from_pretrained(str(test_tokenizer_dir))


@pytest.fixture(scope="module")
def model(tokenizer):
    return load_model(len(tokenizer), seed=0, eos_token_id=tokenizer.eos_token_id)


@pytest.fixture(scope="module")
def info(tokenizer):
    return tokenizer_info(tokenizer)


@pytest.fixture(scope="module")
def engine(test_tokenizer_dir) -> Iterator[RecordingEngine]:
    recording = RecordingEngine(create_app(str(test_tokenizer_dir), seed=0, deterministic_inference=True))
    with serve_app(recording) as url:
        recording.url = url  # type: ignore[attr-defined]
        yield recording


def client_for(proxy) -> tuple[OpenAI, str, str]:
    sid, key = proxy.create_session()
    return OpenAI(base_url=f"{proxy.url}/v1/sessions/{sid}", api_key=key, max_retries=0), sid, key


def assert_valid_calls(message, allowed: set[str], single: bool) -> list[tuple[str, dict]]:
    """Every call names an allowed function and its arguments are valid against its schema."""
    assert message.tool_calls, f"no tool call: {message.content!r}"
    assert not single or len(message.tool_calls) == 1
    calls = []
    for call in message.tool_calls:
        assert call.function.name in allowed
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


def assert_turn_is_the_constrained_models(proxy, sid, key, body, turn, model, info, temperature):
    """The recorded turn is exactly what the engine was asked and the model gives under the grammar."""
    trajectory = proxy.get(sid, key).json()["trajectory"]
    _, output_start, end = trajectory["turns"][turn]
    ids = trajectory["input_ids"]
    assert ids[:output_start] == body["input_ids"]
    expected, ended = masked_score(
        model, info, body["sampling_params"]["ebnf"], ids[:output_start], ids[output_start:end], temperature
    )
    assert ended, "the grammar did not end: the call is incomplete"
    assert trajectory["logprobs"][output_start:end] == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize(
    ("choice", "allowed"),
    [("required", set(SCHEMAS)), (NAMED, {"calculator"})],
    ids=["required", "named"],
)
def test_fifty_seeded_generations_are_each_a_valid_call_recorded_token_exact(
    engine, test_tokenizer_dir, model, info, choice, allowed
):
    with running_proxy(engine.url, test_tokenizer_dir, None, tool_call_parser="qwen25") as proxy:
        names = set()
        for seed in range(50):
            client, sid, key = client_for(proxy)
            reply = client.chat.completions.create(
                model="m", messages=QUESTION, tools=TOOLS, tool_choice=choice, max_tokens=200, seed=seed
            )
            choice_0 = reply.choices[0]
            assert choice_0.finish_reason == "tool_calls" and choice_0.message.content is None
            calls = assert_valid_calls(choice_0.message, allowed, single=isinstance(choice, dict))
            names.update(name for name, _ in calls)
            body = engine.bodies[-1]
            assert "ebnf" in body["sampling_params"] and body["sampling_params"]["sampling_seed"] == seed
            assert_turn_is_the_constrained_models(proxy, sid, key, body, 0, model, info, 1.0)
        assert names == allowed  # required lets the model pick either function


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_auto_and_none_are_unconstrained(engine, test_tokenizer_dir, model, choice):
    with running_proxy(engine.url, test_tokenizer_dir, None, tool_call_parser="qwen25") as proxy:
        for seed in range(5):
            client, sid, key = client_for(proxy)
            reply = client.chat.completions.create(
                model="m", messages=QUESTION, tools=TOOLS, tool_choice=choice, max_tokens=40, seed=seed
            )
            assert not reply.choices[0].message.tool_calls  # the random model writes text
            assert "ebnf" not in engine.bodies[-1]["sampling_params"]
            trajectory = proxy.get(sid, key).json()["trajectory"]
            _, output_start, end = trajectory["turns"][0]
            ids = trajectory["input_ids"]
            expected = score(model, ids[:output_start], ids[output_start:end], 1.0)
            assert trajectory["logprobs"][output_start:end] == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("parser", ["llama3", "deepseekv3", "glm45", "kimi_k2"])
def test_every_family_format_is_enforced(engine, test_tokenizer_dir, model, info, parser):
    """The other parsers' formats, generated by the same model through the test vocabulary (which
    spells their special tokens as text), one call per reply (`parallel_tool_calls: false`: a random
    model goes on calling). gpt-oss is left to the grammar's tests: its optional analysis message is
    free text that a random model never ends."""
    with running_proxy(engine.url, test_tokenizer_dir, None, tool_call_parser=parser) as proxy:
        for seed in range(10):
            for choice, allowed in (("required", set(SCHEMAS)), (NAMED, {"calculator"})):
                client, sid, key = client_for(proxy)
                reply = client.chat.completions.create(
                    model="m",
                    messages=QUESTION,
                    tools=TOOLS,
                    tool_choice=choice,
                    parallel_tool_calls=False,
                    max_tokens=300,
                    seed=seed,
                )
                assert_valid_calls(reply.choices[0].message, allowed, single=True)
                assert_turn_is_the_constrained_models(proxy, sid, key, engine.bodies[-1], 0, model, info, 1.0)


def test_a_multi_turn_tool_conversation_mixes_forced_and_free_turns(engine, test_tokenizer_dir, model, info):
    with running_proxy(engine.url, test_tokenizer_dir, None, tool_call_parser="qwen25") as proxy:
        client, sid, key = client_for(proxy)
        messages = list(QUESTION)
        plan = [("required", set(SCHEMAS)), (NAMED, {"calculator"}), ("auto", None)]
        for turn, (choice, allowed) in enumerate(plan):
            reply = client.chat.completions.create(
                model="m", messages=messages, tools=TOOLS, tool_choice=choice, max_tokens=200, seed=turn
            )
            message = reply.choices[0].message
            body = engine.bodies[-1]
            if allowed is None:
                assert "ebnf" not in body["sampling_params"]
                messages.append(message.model_dump())
                break
            assert_valid_calls(message, allowed, single=isinstance(choice, dict))
            assert_turn_is_the_constrained_models(proxy, sid, key, body, turn, model, info, 1.0)
            messages.append(message.model_dump())
            messages += [
                {"role": "tool", "tool_call_id": call.id, "content": '{"result": 21}'}
                for call in message.tool_calls
            ]
        data = proxy.get(sid, key).json()
        assert data["num_turns"] == 3
        # The free turn after them is the unconstrained model's, after the recorded calls and results.
        _, output_start, end = data["trajectory"]["turns"][2]
        ids = data["trajectory"]["input_ids"]
        assert ids[:output_start] == engine.bodies[-1]["input_ids"]
        expected = score(model, ids[:output_start], ids[output_start:end], 1.0)
        assert data["trajectory"]["logprobs"][output_start:end] == pytest.approx(expected, abs=1e-4)


def test_an_aborted_constrained_generation_starts_over(test_tokenizer_dir, model, info):
    """Resubmitting the tokens made before an abort as prompt would start the grammar over after them:
    the proxy generates the call anew from its prompt, and counts the aborted tokens as discarded."""
    recording = RecordingEngine(create_app(str(test_tokenizer_dir), seed=0, token_delay_s=0.05))
    with (
        serve_app(recording) as engine_url,
        running_proxy(engine_url, test_tokenizer_dir, None, tool_call_parser="qwen25") as proxy,
    ):
        client, sid, key = client_for(proxy)
        replies = []
        turn = threading.Thread(
            target=lambda: replies.append(
                client.chat.completions.create(
                    model="m",
                    messages=QUESTION,
                    tools=TOOLS,
                    tool_choice=NAMED,
                    max_tokens=200,
                    temperature=0,
                )
            )
        )
        turn.start()
        deadline = time.monotonic() + 30
        while httpx.get(f"{engine_url}/emulator_stats").json()["generated_tokens"] < 5:
            assert time.monotonic() < deadline, "the turn never generated"
            time.sleep(0.02)
        assert httpx.post(f"{engine_url}/pause_generation", json={"mode": "abort"}).status_code == 200
        time.sleep(0.3)
        assert httpx.post(f"{engine_url}/continue_generation", json={}).status_code == 200
        turn.join(60)
        assert replies, "the turn did not finish"
        assert_valid_calls(replies[0].choices[0].message, {"calculator"}, single=True)
        first, again = recording.bodies[0], recording.bodies[-1]
        assert len(recording.bodies) == 2 and again["input_ids"] == first["input_ids"]
        assert again["sampling_params"] == first["sampling_params"]  # the whole budget, the same grammar
        assert_turn_is_the_constrained_models(proxy, sid, key, again, 0, model, info, 0)
        totals = proxy.stats()["totals"]
        assert totals["generated_tokens_discarded"] >= 5 and totals["generated_tokens_continued"] == 0


@pytest.mark.router
def test_the_grammar_reaches_the_engines_through_the_real_router(test_tokenizer_dir, tmp_path, model, info):
    """sglang-router 0.3.2 re-serializes /generate: it passes `ebnf` (it would drop `structural_tag`)."""
    with (
        routed_emulators(test_tokenizer_dir, tmp_path, count=2, deterministic_inference=True) as (router, _),
        running_proxy(router, test_tokenizer_dir, None, tool_call_parser="qwen25") as proxy,
    ):
        for seed in range(10):
            for choice, allowed in (("required", set(SCHEMAS)), (NAMED, {"calculator"})):
                client, sid, key = client_for(proxy)
                request = {"tools": TOOLS, "tool_choice": choice}
                reply = client.chat.completions.create(
                    model="m", messages=QUESTION, max_tokens=200, seed=seed, **request
                )
                assert_valid_calls(reply.choices[0].message, allowed, single=isinstance(choice, dict))
                trajectory = proxy.get(sid, key).json()["trajectory"]
                _, output_start, end = trajectory["turns"][0]
                ids = trajectory["input_ids"]
                grammar = tool_choice_grammar(parse_tools(request), "qwen25", None, "")
                assert grammar is not None
                expected, ended = masked_score(
                    model, info, grammar, ids[:output_start], ids[output_start:end], 1.0
                )
                assert ended and trajectory["logprobs"][output_start:end] == pytest.approx(expected, abs=1e-4)


def test_many_tools_get_their_grammar_built_off_the_event_loop(engine, test_tokenizer_dir):
    """From OFFLOAD_TOOLS tools the grammar is built in a worker thread; the call is as valid."""
    many = [
        {"type": "function", "function": {"name": f"tool_{i}", "parameters": CALCULATOR}} for i in range(20)
    ]
    with running_proxy(engine.url, test_tokenizer_dir, None, tool_call_parser="qwen25") as proxy:
        client, _, _ = client_for(proxy)
        reply = client.chat.completions.create(
            model="m", messages=QUESTION, tools=many, tool_choice="required", max_tokens=200, seed=1
        )
        for call in reply.choices[0].message.tool_calls:
            assert call.function.name.startswith("tool_")
            jsonschema.validate(json.loads(call.function.arguments), CALCULATOR)


@pytest.mark.parametrize(
    ("family_name", "reasoning_parser", "template_kwargs"),
    [
        ("llama31", None, {}),
        # R1's prompt opens the think block; with no reasoning parser the call comes at once.
        ("deepseek_r1", None, {}),
        # Thinking off: the prompt holds a closed, empty block, so the call comes first.
        ("glm45", "glm45", {"enable_thinking": False}),
    ],
)
def test_real_vocabularies_write_the_familys_call(family_name, reasoning_parser, template_kwargs):
    """The families' tokenizers (real vocabularies: DeepSeek V3's 128k; Qwen's ranks with Llama's and
    GLM's special tokens) and templates: their call markers are special tokens, which the grammar lets
    the model write as one token or spelled out."""
    from rolloutfleet_testkit.model_families import FAMILIES

    family = FAMILIES[family_name]
    directory = family.build_cached()
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    recording = RecordingEngine(create_app(str(directory), seed=0, deterministic_inference=True))
    family_model = load_model(len(tokenizer), seed=0, eos_token_id=tokenizer.eos_token_id)
    family_info = tokenizer_info(tokenizer)
    with (
        serve_app(recording) as url,
        running_proxy(
            url,
            directory,
            None,
            tool_call_parser=family.tool_call_parser,
            reasoning_parser=reasoning_parser,
            chat_template_kwargs=template_kwargs,
        ) as proxy,
    ):
        for seed in range(3):
            client, sid, key = client_for(proxy)
            reply = client.chat.completions.create(
                model="m",
                messages=QUESTION,
                tools=TOOLS,
                tool_choice=NAMED if seed % 2 else "required",
                parallel_tool_calls=False,
                max_tokens=300,
                seed=seed,
            )
            allowed = {"calculator"} if seed % 2 else set(SCHEMAS)
            assert_valid_calls(reply.choices[0].message, allowed, single=True)
            assert_turn_is_the_constrained_models(
                proxy, sid, key, recording.bodies[-1], 0, family_model, family_info, 1.0
            )
