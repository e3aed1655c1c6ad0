"""The slime and miles adapters end to end on the test stand: a real proxy in front of the real
sglang-router and two SGLang emulators (test stand-ins for GPU engines), the user's agent using the
official `openai` client with the session's capability URL and `api_key="EMPTY"`.

Neither slime nor miles is on PyPI, so their types are stand-ins written from their sources, field
for field: `SlimeSample` from slime's `slime/utils/types.py` (THUDM/slime 0d234f3: the fields a
generate function fills, and `Sample.Status`), and miles' `GenerateFnInput` / `GenerateFnOutput`
from `miles/rollout/base_types.py` (radixark/miles), installed as a `miles` package on sys.path.
What the adapter writes is checked against references computed here: the chat template of the
first request (the prompt), the emulator's own teacher-forced scoring of every generated span
(logprobs, under the weights of the version recorded for it), the replies the agent received."""

from __future__ import annotations

import asyncio
import enum
import textwrap
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI
from proxy_harness import ADMIN_KEY, running_proxy
from rolloutfleet_client.adapters import FleetConfig
from rolloutfleet_client.adapters.slime import miles_generate, request_kwargs, slime_generate
from rolloutfleet_client.calculator import CALCULATOR_TOOL, run_tool_call
from rolloutfleet_testkit.calculator_model import CalculatorModel
from rolloutfleet_testkit.processes import serve_app
from rolloutfleet_testkit.routed_engines import routed_emulators
from rolloutfleet_testkit.sglang_emulator.model import load_model, score
from rolloutfleet_testkit.sglang_emulator.server import write_weights
from rolloutfleet_testkit.upstream_stub import create_app as create_stub_app
from transformers import AutoTokenizer


@dataclass
class SlimeSample:
    """Stand-in for slime's `Sample` (slime/utils/types.py): the fields a generate function reads
    and fills, with their defaults."""

    group_index: int | None = None
    index: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    multimodal_inputs: dict[str, Any] | None = None  # raw images: {"images": [PIL.Image, ...]}
    multimodal_train_inputs: dict[str, Any] | None = None  # the processor's pixel_values, image_grid_thw

    class Status(enum.Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    session_id: str | None = None


MILES_BASE_TYPES = '''
    """Stand-in for miles.rollout.base_types (radixark/miles): the generate function's input and output."""
    from dataclasses import dataclass
    from typing import Any


    @dataclass(frozen=True)
    class GenerateFnInput:
        state: Any
        sample: Any
        sampling_params: dict
        evaluation: bool

        @property
        def args(self):
            return self.state.args


    @dataclass(frozen=True)
    class GenerateFnOutput:
        samples: Any
'''

SAMPLING = {"max_new_tokens": 6, "temperature": 0.0, "top_p": 1.0, "skip_special_tokens": False}
QUESTION = [{"role": "user", "content": "Add 2 and 3, then explain."}]


# Per decode step. The weight-update test pauses the engines 0.3 s after the turn is in flight: its
# 40 tokens then take 3.2 s, so the pause lands mid-turn even when a loaded machine delays it by
# seconds (at 20 ms a step it once came after the turn had ended).
TOKEN_DELAY_S = {"test_a_weight_update_the_trainer_drives_at_the_engines_mid_turn_is_ridden_through": 0.08}


@pytest.fixture
def stand(test_tokenizer_dir, tmp_path, request):
    """(proxy, engine URLs, fleet config): the proxy writes exports to its dump volume."""
    delay = TOKEN_DELAY_S.get(request.node.originalname, 0.02)
    with (
        routed_emulators(test_tokenizer_dir, tmp_path, token_delay_s=delay) as (router_url, engines),
        running_proxy(router_url, test_tokenizer_dir, tmp_path / "dumps") as proxy,
    ):
        yield proxy, engines, FleetConfig(ADMIN_KEY, [proxy.url])


@pytest.fixture(scope="module")
def tokenizer(test_tokenizer_dir):
    return AutoTokenizer.from_pretrained(str(test_tokenizer_dir))


def two_turns(replies: list[Any], last_max_tokens: int):
    """The user's agent (miles' agent-function contract): two turns with the official client; the
    second cut at `last_max_tokens`. Returns its reward and a note for the reward model."""

    async def agent(base_url, prompt, request_kwargs, metadata, **_):
        client = AsyncOpenAI(base_url=base_url, api_key="EMPTY", max_retries=0)
        messages = list(prompt)
        first = await client.chat.completions.create(model="m", messages=messages, **request_kwargs)
        replies.append(first.choices[0])
        messages += [{"role": "assistant", "content": first.choices[0].message.content}]
        messages += [{"role": "user", "content": "And in one word?"}]
        second = await client.chat.completions.create(
            model="m", messages=messages, **{**request_kwargs, "max_tokens": last_max_tokens}
        )
        replies.append(second.choices[0])
        await client.close()
        return {"reward": 0.5, "agent_note": metadata["task"]}

    return agent


def generated_spans(mask: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each run of 1s in a loss mask."""
    spans, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def check_against_references(sample, tokenizer, replies, models: dict[int, Any]) -> None:
    prompt_ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True)[
        "input_ids"
    ]
    prompt_length = len(sample.tokens) - sample.response_length
    assert sample.tokens[:prompt_length] == prompt_ids  # the prompt is the template's rendering
    assert len(sample.loss_mask) == len(sample.rollout_log_probs) == sample.response_length
    spans = generated_spans(sample.loss_mask)
    assert len(spans) == len(replies) == 2 and spans[0][0] == 0  # one generated span per turn
    versions = [int(v) for v in sample.weight_versions]
    for (start, end), reply in zip(spans, replies, strict=True):
        start, end = start + prompt_length, end + prompt_length
        text = tokenizer.decode(sample.tokens[start:end], skip_special_tokens=True)
        assert text == reply.message.content  # what the agent was answered is what is trained on
        logprobs = sample.rollout_log_probs[start - prompt_length : end - prompt_length]
        expected = [score(models[v], sample.tokens[:start], sample.tokens[start:end], 0.0) for v in versions]
        assert any(logprobs == pytest.approx(e, abs=1e-4) for e in expected), "the engine's own logprobs"
    # Off the mask: 0.0 logprobs, the tokens the template renders between the turns.
    assert all(lp == 0.0 for lp, m in zip(sample.rollout_log_probs, sample.loss_mask, strict=True) if not m)


def models_for(tokenizer, seeds: dict[int, int]) -> dict[int, Any]:
    return {
        v: load_model(len(tokenizer), seed=s, eos_token_id=tokenizer.eos_token_id) for v, s in seeds.items()
    }


@pytest.mark.router
def test_slime_generate_fills_the_sample_from_the_record_and_marks_a_length_cut(stand, tokenizer):
    proxy, _, config = stand
    replies: list[Any] = []
    generate = slime_generate(two_turns(replies, last_max_tokens=2), config=config, tokenizer=tokenizer)
    sample = SlimeSample(index=7, group_index=1, prompt=QUESTION, metadata={"task": "add-2-3"})
    returned = asyncio.run(generate(object(), sample, dict(SAMPLING)))
    assert returned is sample  # filled in place, as slime's own generate functions do
    assert replies[-1].finish_reason == "length"
    assert sample.status is SlimeSample.Status.TRUNCATED
    # The dict the agent returned is merged into the metadata (for the reward model), verbatim.
    assert sample.reward == 0.5 and sample.metadata == {
        "task": "add-2-3",
        "reward": 0.5,
        "agent_note": "add-2-3",
    }
    assert sample.weight_versions == ["0"] and sample.session_id
    assert sample.response == tokenizer.decode(sample.tokens[len(sample.tokens) - sample.response_length :])
    check_against_references(sample, tokenizer, replies, models_for(tokenizer, {0: 0}))
    # Taken: exported, written to the dump volume and acknowledged, so no trainer export sees it again.
    assert proxy.stats()["live_sessions"] == 0


@pytest.mark.router
def test_a_weight_update_the_trainer_drives_at_the_engines_mid_turn_is_ridden_through(
    stand, tokenizer, tmp_path
):
    """As slime updates weights: pause every engine in abort mode, load the new weights with their
    version, continue; not through the proxy. The turn in flight keeps its tokens and goes on under
    the new weights; the sample names both versions, each span scored by its own weights."""
    proxy, engines, config = stand
    weights = write_weights(tmp_path / "v1", seed=7)
    replies: list[Any] = []
    generate = slime_generate(two_turns(replies, last_max_tokens=40), config=config)
    sample = SlimeSample(index=0, prompt=QUESTION, metadata={"task": "update"})
    sampling = {**SAMPLING, "max_new_tokens": 40}

    async def rollout_with_an_update():
        episode = asyncio.create_task(generate(object(), sample, sampling))
        deadline = time.monotonic() + 30
        while proxy.stats()["inflight_turns"] < 1 or len(replies) < 1:  # the second turn generates
            assert time.monotonic() < deadline and not episode.done()
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)  # a few tokens under the old weights
        async with httpx.AsyncClient(timeout=30) as http:
            for engine in engines:
                assert (
                    await http.post(f"{engine}/pause_generation", json={"mode": "abort"})
                ).status_code == 200
            for engine in engines:
                body = {"model_path": str(weights), "weight_version": "1", "flush_cache": True}
                assert (await http.post(f"{engine}/update_weights_from_disk", json=body)).json()["success"]
            for engine in engines:
                assert (await http.post(f"{engine}/continue_generation", json={})).status_code == 200
        return await episode

    asyncio.run(rollout_with_an_update())
    assert sample.weight_versions == ["0", "1"], sample.weight_versions
    assert sample.status in (SlimeSample.Status.COMPLETED, SlimeSample.Status.TRUNCATED)
    totals = proxy.stats()["totals"]
    assert totals["generated_tokens_discarded"] == 0 and totals["generated_tokens_continued"] > 0
    # The second turn spans the update: its tokens before and after it are scored by their weights.
    prompt_length = len(sample.tokens) - sample.response_length
    start, end = (s + prompt_length for s in generated_spans(sample.loss_mask)[1])
    generated = sample.rollout_log_probs[start - prompt_length : end - prompt_length]
    models = models_for(tokenizer, {0: 0, 1: 7})
    split = next(
        i
        for i in range(start + 1, end)
        if generated[: i - start]
        == pytest.approx(score(models[0], sample.tokens[:start], sample.tokens[start:i], 0.0), abs=1e-4)
        and generated[i - start :]
        == pytest.approx(score(models[1], sample.tokens[:i], sample.tokens[i:end], 0.0), abs=1e-4)
    )
    assert start < split < end


@pytest.mark.router
def test_miles_generate_takes_its_input_and_returns_its_output(stand, tokenizer, tmp_path, monkeypatch):
    package = tmp_path / "miles_stand_in" / "miles" / "rollout"
    package.mkdir(parents=True)
    (package.parent / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "base_types.py").write_text(textwrap.dedent(MILES_BASE_TYPES))
    monkeypatch.syspath_prepend(str(tmp_path / "miles_stand_in"))
    from miles.rollout.base_types import GenerateFnInput, GenerateFnOutput

    _, _, config = stand
    replies: list[Any] = []
    generate = miles_generate(two_turns(replies, last_max_tokens=6), config=config)
    original = SlimeSample(index=3, prompt=QUESTION, metadata={"task": "miles"})
    given = GenerateFnInput(state=None, sample=original, sampling_params=dict(SAMPLING), evaluation=False)
    output = asyncio.run(generate(given))
    assert isinstance(output, GenerateFnOutput) and len(output.samples) == 1
    (sample,) = output.samples
    assert sample is not original and original.tokens == []  # the input's sample is left as given
    assert sample.reward == 0.5 and sample.metadata["agent_note"] == "miles"
    expected_status = {"length": SlimeSample.Status.TRUNCATED, "stop": SlimeSample.Status.COMPLETED}
    assert sample.status is expected_status[replies[-1].finish_reason]
    check_against_references(sample, tokenizer, replies, models_for(tokenizer, {0: 0}))


def test_sampling_parameters_become_chat_completion_fields():
    given = {
        "max_new_tokens": 8,
        "sampling_seed": 3,
        "temperature": 0.7,
        "stop_token_ids": [1],
        "top_k": None,
    }
    assert request_kwargs(given) == {"max_tokens": 8, "seed": 3, "temperature": 0.7}


@pytest.mark.router
def test_a_tool_episode_fills_the_sample_with_the_tool_result_masked_out(
    test_tokenizer_dir, tokenizer, tmp_path
):
    """The agent offers the calculator; the model (a stand-in that calls it, then answers with its
    result) calls it, the agent runs the tool and sends the result back. The tool result's tokens are
    in the sample, masked out; the model's two replies are trained on."""
    stub = create_stub_app(0.0, 4, ruled=CalculatorModel(test_tokenizer_dir).replies())
    replies: list[Any] = []

    async def agent(base_url, prompt, request_kwargs, metadata, **_):
        client = AsyncOpenAI(base_url=base_url, api_key="EMPTY", max_retries=0)
        messages = list(prompt)
        called = await client.chat.completions.create(
            model="m", messages=messages, tools=[CALCULATOR_TOOL], **request_kwargs
        )
        replies.append(called.choices[0])
        messages.append(called.choices[0].message.model_dump(exclude_none=True))
        for call in called.choices[0].message.tool_calls or []:
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": run_tool_call(call.model_dump())}
            )
        answer = await client.chat.completions.create(
            model="m", messages=messages, tools=[CALCULATOR_TOOL], **request_kwargs
        )
        replies.append(answer.choices[0])
        await client.close()
        return 1.0 if "42" in (answer.choices[0].message.content or "") else 0.0

    with (
        serve_app(stub) as url,
        running_proxy(url, test_tokenizer_dir, tmp_path / "dumps", tool_call_parser="qwen25") as proxy,
    ):
        config = FleetConfig(ADMIN_KEY, [proxy.url])
        generate = slime_generate(agent, config=config, tokenizer=tokenizer)
        question = [{"role": "user", "content": "What is 12 + 30?"}]
        sample = SlimeSample(index=1, prompt=question, metadata={"task": "add"})
        asyncio.run(generate(object(), sample, {"max_new_tokens": 64}))
    assert replies[0].finish_reason == "tool_calls" and replies[1].finish_reason == "stop"
    assert sample.reward == 1.0 and sample.status is SlimeSample.Status.COMPLETED
    prompt_length = len(sample.tokens) - sample.response_length
    spans = [(a + prompt_length, b + prompt_length) for a, b in generated_spans(sample.loss_mask)]
    assert len(spans) == 2
    between = tokenizer.decode(sample.tokens[spans[0][1] : spans[1][0]])
    assert "<|im_start|>tool\n42<|im_end|>" in between  # the tool result as the template renders it
    assert "The answer is 42." in tokenizer.decode(sample.tokens[spans[1][0] : spans[1][1]])
    assert '"calculator"' in tokenizer.decode(sample.tokens[spans[0][0] : spans[0][1]])
