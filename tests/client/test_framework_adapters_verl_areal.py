"""The verl and AReaL adapters (rolloutfleet_client.adapters.verl, .areal) run by the frameworks' own
code: `framework_driver.py`, in the frameworks' environment (ROLLOUTFLEET_FRAMEWORKS_PYTHON, built by
./dev from e2e/frameworks/), drives verl's AgentLoopWorker.generate_sequences or AReaL's workflow and
its trajectory checks, against a real proxy on loopback; what the framework got is compared field by
field with the proxy's own record of the session (the export batch it answered the adapter with) and
with the upstream's: the calculator model's replies and logprobs (a tool episode), the SGLang emulator's
scoring of its logprobs (a length cut-off; a weight update mid-turn, driven at the engines the way
that framework drives it, behind the real sglang-router)."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from proxy_harness import ADMIN_KEY, running_proxy
from rolloutfleet_testkit.calculator_model import CalculatorModel
from rolloutfleet_testkit.processes import serve_app
from rolloutfleet_testkit.routed_engines import routed_emulators
from rolloutfleet_testkit.upstream_stub import create_app as create_stub_app
from rolloutfleet_testkit.upstream_stub import reply_logprobs
from rolloutfleet_wire.export_format import decode_batch
from transformers import AutoTokenizer

DRIVER = Path(__file__).with_name("framework_driver.py")
TEMPERATURE = 0.8  # the driver's: verl's rollout.temperature, and the AReaL agent's


@pytest.fixture(scope="module")
def frameworks_python() -> str:
    python = os.environ.get("ROLLOUTFLEET_FRAMEWORKS_PYTHON")
    if not python:
        if os.environ.get("CI"):
            pytest.fail("ROLLOUTFLEET_FRAMEWORKS_PYTHON is not set: run the tests with ./dev test")
        pytest.skip("ROLLOUTFLEET_FRAMEWORKS_PYTHON is not set (./dev sets it)")
    return python


def keeping_exports(batches: list[bytes]):
    """An ASGI wrapper that keeps the body of every export the proxy answers (the proxy's record of
    the session as it handed it to the adapter)."""

    def wrap(app):
        async def wrapped(scope, receive, send):
            if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != "/v1/exports":
                return await app(scope, receive, send)
            body: list[bytes] = []

            async def keep(message):
                if message["type"] == "http.response.body":
                    body.append(message.get("body", b""))
                    if not message.get("more_body"):
                        batches.append(b"".join(body))
                await send(message)

            return await app(scope, receive, keep)

        return wrapped

    return wrap


class Fleet:
    def __init__(self, proxy, batches: list[bytes], engines: list[str] | None = None):
        self.proxy, self.batches, self.engines = proxy, batches, engines or []

    def record(self) -> dict:
        """The one sample of the last export: the session the driver just took."""
        batch = decode_batch(self.batches[-1])
        assert batch.num_trajectories == 1
        return batch.trajectory(0)


@pytest.fixture(scope="module")
def calculator_fleet(test_tokenizer_dir, tmp_path_factory):
    """A proxy (with Qwen 2.5's tool-call parser) in front of a model that calls the calculator."""
    batches: list[bytes] = []
    stub = create_stub_app(0.0, 4, ruled=CalculatorModel(test_tokenizer_dir).replies())
    dumps = tmp_path_factory.mktemp("calculator-dumps")
    with (
        serve_app(stub) as url,
        running_proxy(
            url, test_tokenizer_dir, dumps, tool_call_parser="qwen25", wrap_app=keeping_exports(batches)
        ) as proxy,
    ):
        yield Fleet(proxy, batches)


@pytest.fixture(scope="module")
def emulated_fleet(test_tokenizer_dir, tmp_path_factory):
    """A proxy in front of the real sglang-router over two SGLang emulators (50 ms a token, so a turn
    is in flight when the trainer aborts the engines), deterministic as with SGLang's
    --enable-deterministic-inference: the agents' `seed` makes their turns' lengths reproducible."""
    batches: list[bytes] = []
    logs = tmp_path_factory.mktemp("router-logs")
    emulators = routed_emulators(test_tokenizer_dir, logs, token_delay_s=0.05, deterministic_inference=True)
    with (
        emulators as (router_url, engines),
        running_proxy(
            router_url, test_tokenizer_dir, logs / "dumps", abort_ride_through_s=60,
            wrap_app=keeping_exports(batches),
        ) as proxy,
    ):  # fmt: skip
        yield Fleet(proxy, batches, engines)


@pytest.fixture(scope="module")
def tokenizer(test_tokenizer_dir):
    return AutoTokenizer.from_pretrained(str(test_tokenizer_dir))


@pytest.fixture(scope="module")
def emulator_models(tokenizer):
    """The emulators' weights before (seed 0) and after (seed 7) the update."""
    from rolloutfleet_testkit.sglang_emulator.model import load_model

    return {s: load_model(len(tokenizer), seed=s, eos_token_id=tokenizer.eos_token_id) for s in (0, 7)}


def start_driver(python: str, fleet: Fleet, tmp_path: Path, tokenizer_dir, **spec) -> subprocess.Popen:
    env = {
        **os.environ,
        "ROLLOUTFLEET_ENDPOINTS": fleet.proxy.url,
        "ROLLOUTFLEET_ADMIN_KEY": ADMIN_KEY,
        "HF_HUB_OFFLINE": "1",
        # The driver's own folder on the path: verl's config names the agent `framework_driver:...`.
        "PYTHONPATH": str(DRIVER.parent),
    }
    spec = {"work_dir": str(tmp_path), "tokenizer_dir": str(tokenizer_dir), **spec}
    return subprocess.Popen(
        [python, str(DRIVER), json.dumps(spec)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finished(driver: subprocess.Popen) -> dict:
    out, err = driver.communicate(timeout=240)
    assert driver.returncode == 0, err[-4000:]
    return json.loads(out.strip().splitlines()[-1])


def run_driver(python, fleet, tmp_path, tokenizer_dir, **spec) -> dict:
    return finished(start_driver(python, fleet, tmp_path, tokenizer_dir, **spec))


def split(record: dict) -> tuple[list[int], dict]:
    """The record's prompt (before the first generated token) and its response's per-token fields."""
    start = record["turn_bounds"][0][1]
    fields = ("input_ids", "loss_mask", "logprobs", "versions")
    return record["input_ids"][:start], {f: record[f][start:] for f in fields}


def check_verl(got: dict, record: dict, prompt_length: int, response_length: int) -> None:
    """verl's padded batch (AgentLoopWorker._postprocess) against the record: the prompt left-padded,
    the response (cut at response_length) right-padded, masks, logprobs, the reward on the last token."""
    tensors, pad = got["tensors"], got["pad_token_id"]
    prompt, response = split(record)
    kept = len(response["input_ids"][:response_length])
    prompt_pad, response_pad = prompt_length - len(prompt), response_length - kept
    assert tensors["prompts"] == [pad] * prompt_pad + prompt
    assert tensors["responses"] == response["input_ids"][:response_length] + [pad] * response_pad
    assert tensors["input_ids"] == tensors["prompts"] + tensors["responses"]
    assert tensors["response_mask"] == response["loss_mask"][:response_length] + [0] * response_pad
    assert tensors["attention_mask"] == [0] * prompt_pad + [1] * (len(prompt) + kept) + [0] * response_pad
    assert tensors["rollout_log_probs"] == pytest.approx(
        response["logprobs"][:response_length] + [0.0] * response_pad, abs=1e-6
    )
    if record["reward"] is None:
        assert "rm_scores" not in tensors
    else:
        assert tensors["rm_scores"] == [0.0] * (kept - 1) + [record["reward"]] + [0.0] * response_pad
    extras = got["non_tensor"]
    assert extras["session_id"] == record["session_id"]
    assert extras["turn_finishes"] == record["turn_finishes"]
    assert extras["__num_turns__"] == 2 * len(record["turn_bounds"])


def check_areal(got: dict, record: dict) -> None:
    """AReaL's trajectory against the record: [1, T] tensors of the whole sequence in AReaL's dtypes,
    the prompt masked out (logprob 0.0, version -1) as AReaL's own workflows mark it."""
    prompt, response = split(record)
    total = len(record["input_ids"])
    assert got["dtypes"] == {
        "input_ids": "torch.int32",
        "loss_mask": "torch.int32",
        "logprobs": "torch.float32",
        "versions": "torch.int32",
        "attention_mask": "torch.bool",
        "rewards": "torch.float32",
    }
    assert got["shapes"] == {**{k: [1, total] for k in got["shapes"] if k != "rewards"}, "rewards": [1]}
    assert got["batched_shapes"]["input_ids"] == [2, total]
    tensors = {k: v[0] if k != "rewards" else v for k, v in got["tensors"].items()}
    assert tensors["input_ids"] == record["input_ids"]
    assert tensors["loss_mask"] == [0] * len(prompt) + response["loss_mask"]
    assert tensors["logprobs"] == pytest.approx([0.0] * len(prompt) + response["logprobs"], abs=1e-6)
    assert tensors["versions"] == [-1] * len(prompt) + response["versions"]
    assert tensors["attention_mask"] == [True] * total
    assert tensors["rewards"] == [record["reward"] or 0.0]


def generated(record: dict) -> list[tuple[int, int]]:
    return [(output_start, end) for _, output_start, end in record["turn_bounds"]]


# --- a two-turn tool episode --------------------------------------------------------------------


@pytest.mark.parametrize("framework", ["verl", "areal"])
def test_a_tool_episode_reaches_the_framework_as_the_proxy_recorded_it(
    framework, frameworks_python, calculator_fleet, test_tokenizer_dir, tokenizer, tmp_path
):
    got = run_driver(
        frameworks_python, calculator_fleet, tmp_path, test_tokenizer_dir,
        framework=framework, scenario="tool", prompt_length=256, response_length=256,
    )  # fmt: skip
    record = calculator_fleet.record()
    # The agent saw the model call the calculator, then answer with its result.
    assert [s["finish_reason"] for s in got["seen"]] == ["tool_calls", "stop"]
    assert got["seen"][1]["content"] == "The answer is 42."
    assert record["reward"] == 1.0 and record["turn_finishes"] == ["stop", "stop"]
    assert record["metadata"]["framework"] == framework
    # The upstream's own replies and logprobs, turn by turn; the tool's result between them, masked out.
    (first_start, first_end), (second_start, second_end) = generated(record)
    ids = record["input_ids"]
    assert '"expression": "12 + 30"' in tokenizer.decode(ids[first_start:first_end])
    assert tokenizer.decode(ids[second_start:second_end], skip_special_tokens=True) == "The answer is 42."
    assert "42" in tokenizer.decode(ids[first_end:second_start])
    for start, end in ((first_start, first_end), (second_start, second_end)):
        assert record["logprobs"][start:end] == pytest.approx(reply_logprobs(end - start), abs=1e-6)
        assert record["loss_mask"][start:end] == [1] * (end - start)
    assert record["loss_mask"][first_end:second_start] == [0] * (second_start - first_end)
    if framework == "verl":
        check_verl(got, record, 256, 256)
        assert got["non_tensor"]["truncated"] is False
    else:
        check_areal(got, record)


# --- a length cut-off ---------------------------------------------------------------------------


@pytest.mark.router
@pytest.mark.parametrize("framework", ["verl", "areal"])
def test_turns_cut_at_their_max_tokens_and_verl_cuts_the_response_at_its_length(
    framework, frameworks_python, emulated_fleet, emulator_models, test_tokenizer_dir, tmp_path
):
    from rolloutfleet_testkit.sglang_emulator.model import score

    # verl's response_length (10) is shorter than the two turns of 6 tokens and the user turn between.
    got = run_driver(
        frameworks_python, emulated_fleet, tmp_path, test_tokenizer_dir,
        framework=framework, scenario="length", prompt_length=64, response_length=10,
    )  # fmt: skip
    record = emulated_fleet.record()
    assert [s["finish_reason"] for s in got["seen"]] == ["length", "length"]
    assert record["turn_finishes"] == ["length", "length"] and record["reward"] == 0.5
    ids = record["input_ids"]
    for start, end in generated(record):
        assert end - start == 6
        # The emulator's own scoring of its tokens (weights of seed 0, tempered at the turn's 0.8).
        expected = score(emulator_models[0], ids[:start], ids[start:end], TEMPERATURE)
        assert record["logprobs"][start:end] == pytest.approx(expected, abs=1e-4)
    if framework == "verl":
        assert len(split(record)[1]["input_ids"]) > 10, "the response is longer than verl's response_length"
        check_verl(got, record, 64, 10)
        assert got["non_tensor"]["truncated"] is True
    else:
        check_areal(got, record)
        assert sum(got["tensors"]["loss_mask"][0]) == 12


# --- a weight update in the middle of a turn, driven at the engines as the framework drives it ---


def engine_stats(engine: str) -> dict:
    return httpx.get(f"{engine}/emulator_stats", timeout=10).json()


def update_as_verl(engine: str, weights: Path) -> None:
    # verl's checkpoint engine: abort_all_requests (SGLang's pause_generation in abort mode), the
    # transfer (NCCL or NIXL: to the emulator, a load from disk), resume_generation. No weight version.
    assert httpx.post(f"{engine}/pause_generation", json={"mode": "abort"}, timeout=30).is_success
    assert httpx.post(
        f"{engine}/update_weights_from_disk", json={"model_path": str(weights)}, timeout=60
    ).json()["success"]
    assert httpx.post(f"{engine}/continue_generation", json={}, timeout=30).is_success


def update_as_areal(engine: str, weights: Path) -> None:
    # AReaL's SGLang backend (areal/engine/sglang_remote.py): /pause_generation with an empty body
    # (SGLang's default mode aborts), /update_weights_from_disk aborting all requests, /continue_generation.
    assert httpx.post(f"{engine}/pause_generation", json={}, timeout=30).is_success
    body = {"model_path": str(weights), "abort_all_requests": True}
    assert httpx.post(f"{engine}/update_weights_from_disk", json=body, timeout=60).json()["success"]
    assert httpx.post(f"{engine}/continue_generation", json={}, timeout=30).is_success


@pytest.mark.router
@pytest.mark.parametrize("framework", ["verl", "areal"])
def test_a_weight_update_mid_turn_is_ridden_through_and_reaches_the_framework_whole(
    framework, frameworks_python, emulated_fleet, emulator_models, test_tokenizer_dir, tmp_path, tokenizer
):
    from rolloutfleet_testkit.sglang_emulator.model import score
    from rolloutfleet_testkit.sglang_emulator.server import write_weights

    proxy, engines = emulated_fleet.proxy, emulated_fleet.engines
    before = proxy.stats()["totals"]
    weights = write_weights(tmp_path / "policy-v1", seed=7)
    driver = start_driver(
        frameworks_python, emulated_fleet, tmp_path, test_tokenizer_dir,
        framework=framework, scenario="update", prompt_length=64, response_length=64,
    )  # fmt: skip
    try:
        # The update comes once the engines have made a few of the turn's tokens (50 ms each; with
        # the agent's seed the old weights make 33 before EOS): tokens before it and after it.
        deadline = time.monotonic() + 180  # the driver imports its framework first
        while not any(engine_stats(e)["running"] for e in engines):
            assert driver.poll() is None, driver.communicate()[1][-4000:]
            assert time.monotonic() < deadline, "the agent's turn never started"
            time.sleep(0.02)
        made = sum(engine_stats(e)["generated_tokens"] for e in engines)
        while sum(engine_stats(e)["generated_tokens"] for e in engines) < made + 3:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        update = update_as_verl if framework == "verl" else update_as_areal
        updates = [threading.Thread(target=update, args=(engine, weights)) for engine in engines]
        for thread in updates:
            thread.start()
        for thread in updates:
            thread.join(120)
        got = finished(driver)
    finally:
        if driver.poll() is None:
            driver.kill()
        original = write_weights(tmp_path / "policy-v0", seed=0)
        for engine in engines:  # the next test starts from the weights of seed 0
            httpx.post(f"{engine}/update_weights_from_disk", json={"model_path": str(original)}, timeout=60)
    totals = proxy.stats()["totals"]
    assert totals["turns_continued"] > before["turns_continued"], "the update aborted the turn"
    assert totals["generated_tokens_discarded"] == before["generated_tokens_discarded"] == 0
    record = emulated_fleet.record()
    [(start, end)] = generated(record)
    ids = record["input_ids"]
    assert end - start == 60 or ids[end - 1] == tokenizer.eos_token_id
    assert got["seen"][0]["finish_reason"] in ("length", "stop")
    # Tokens made before the abort are scored by the old weights; the rest by the new ones, from the
    # continuation's prompt (which holds the first part), as the emulator scores each request.
    logprobs = record["logprobs"][start:end]
    old = score(emulator_models[0], ids[:start], ids[start:end], TEMPERATURE)
    change = next((i for i, (a, b) in enumerate(zip(logprobs, old, strict=True)) if abs(a - b) > 1e-4), None)
    assert change is not None and change >= 1, "tokens were made before the update, and after it"
    new = score(emulator_models[7], ids[: start + change], ids[start + change : end], TEMPERATURE)
    assert logprobs[change:] == pytest.approx(new, abs=1e-4)
    if framework == "verl":
        check_verl(got, record, 64, 64)
    else:
        check_areal(got, record)
