"""The SGLang emulator's mixture-of-experts mode reports routing as SGLang's source says
(`RoutedExpertsCapturer.get_routed_experts`, `Scheduler.maybe_collect_routed_experts`,
`DetokenizerManager._extract_routed_experts`, `GenerateReqInput.routed_experts_start_len`): one int32
row per forwarded position, prompt included, never the last output token, base64 in
`meta_info.routed_experts`, only with `--enable-return-routed-experts` and when asked. Real uvicorn
servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import base64
import time

import httpx
import numpy as np
import pytest
from rolloutfleet_testkit.moe_model import moe_model_dir
from rolloutfleet_testkit.processes import serve_app
from rolloutfleet_testkit.sglang_emulator.model import MoeConfig, load_model, route, score
from rolloutfleet_testkit.sglang_emulator.server import create_app

MOE = MoeConfig(layers=3, top_k=2, experts=300)  # ids above 255: SGLang's int32 rows carry them
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


@pytest.fixture(scope="module")
def model_dir(test_tokenizer_dir, tmp_path_factory):
    return moe_model_dir(
        test_tokenizer_dir, tmp_path_factory.mktemp("moe"), MOE.layers, MOE.top_k, MOE.experts
    )


def rows(answer: dict) -> np.ndarray:
    data = base64.b64decode(answer["meta_info"]["routed_experts"])
    return np.frombuffer(data, "<i4").reshape(-1, MOE.layers, MOE.top_k)


def body(ids: list[int], max_new_tokens: int = 8, **extra) -> dict:
    sampling = {"max_new_tokens": max_new_tokens, "temperature": 0}
    return {"input_ids": ids, "sampling_params": sampling, "return_logprob": True, **extra}


async def test_routing_covers_every_forwarded_position_and_matches_the_model(model_dir):
    with serve_app(create_app(str(model_dir), seed=2, routed_experts=True)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            answer = (await client.post("/generate", json=body(PROMPT, return_routed_experts=True))).json()
            output = answer["output_ids"]
            got = rows(answer)
            assert got.shape == (len(PROMPT) + len(output) - 1, MOE.layers, MOE.top_k)
            assert np.array_equal(got, route(PROMPT + output[:-1], 2, MOE)[0])
            assert int(got.max()) >= 256 and int(got.min()) >= 0  # all 300 experts are routed to
            # Routing is part of the model: its logprobs are the reference's, experts included.
            model = load_model(str(model_dir), seed=2)
            logprobs = [entry[0] for entry in answer["meta_info"]["output_token_logprobs"]]
            assert logprobs == pytest.approx(score(model, PROMPT, output, temperature=0), abs=1e-5)
            dense = load_model(len(model.embed.weight), seed=2, eos_token_id=model.eos_token_id)
            assert score(dense, PROMPT, output, 0) != pytest.approx(logprobs, abs=1e-3)

            # From routed_experts_start_len on, the cached prefix included.
            start = len(PROMPT) + len(output) - 1
            again = (
                await client.post(
                    "/generate",
                    json=body(PROMPT + output, 4, return_routed_experts=True, routed_experts_start_len=start),
                )
            ).json()
            assert again["meta_info"]["cached_tokens"] == start
            reference = route(PROMPT + output + again["output_ids"][:-1], 2, MOE)[0]
            assert np.array_equal(rows(again), reference[start:])

            bad = await client.post(
                "/generate", json=body(PROMPT, return_routed_experts=True, routed_experts_start_len=9)
            )
            assert bad.status_code == 400
            plain = (await client.post("/generate", json=body(PROMPT))).json()
            assert "routed_experts" not in plain["meta_info"]  # not asked


async def test_without_the_server_flag_routing_is_never_answered(model_dir):
    with serve_app(create_app(str(model_dir), seed=2)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            answer = (await client.post("/generate", json=body(PROMPT, return_routed_experts=True))).json()
            assert answer["output_ids"] and "routed_experts" not in answer["meta_info"]


async def test_an_aborted_request_answers_the_rows_of_what_it_forwarded(model_dir):
    with serve_app(create_app(str(model_dir), seed=2, routed_experts=True, token_delay_s=0.05)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            pending = asyncio.create_task(
                client.post("/generate", json=body(PROMPT, 200, return_routed_experts=True, rid="r1"))
            )
            deadline = time.monotonic() + 30
            while (await client.get("/emulator_stats")).json()["generated_tokens"] < 3:
                assert time.monotonic() < deadline, "three tokens generated"
                await asyncio.sleep(0.01)
            assert (await client.post("/abort_request", json={"rid": "r1"})).status_code == 200
            answer = (await pending).json()
            assert answer["meta_info"]["finish_reason"]["type"] == "abort"
            output = answer["output_ids"]
            assert np.array_equal(rows(answer), route(PROMPT + output[:-1], 2, MOE)[0])
