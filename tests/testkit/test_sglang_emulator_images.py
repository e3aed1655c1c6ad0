"""The SGLang emulator takes images as SGLang's Qwen-VL path does, one behaviour per test; each names
the SGLang function it follows (e2e/rolloutfleet_testkit/sglang_emulator/multimodal.py has the list).
Real uvicorn servers on 127.0.0.1, the Qwen2.5-VL and Qwen3-VL model directories of the test kit, and
expected ids from tests/vl_reference.py (template + transformers' image processor)."""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Iterator

import httpx
import orjson
import pytest
from rolloutfleet_testkit.model_families import VL_FAMILIES
from rolloutfleet_testkit.processes import serve_app
from rolloutfleet_testkit.screenshots import data_uri, image_part, screenshot
from rolloutfleet_testkit.sglang_emulator.server import create_app
from transformers import AutoTokenizer
from vl_reference import expanded_prompt, image_processor

PAD, START, END = 151655, 151652, 151653


@pytest.fixture(scope="module", params=["qwen25_vl", "qwen3_vl"])
def family(request):
    directory = VL_FAMILIES[request.param].build_cached()
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    return request.param, directory, tokenizer, image_processor(directory)


@pytest.fixture(scope="module")
def qwen25_vl():
    directory = VL_FAMILIES["qwen25_vl"].build_cached()
    return directory, AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


@contextlib.contextmanager
def emulator(directory, **options) -> Iterator[str]:
    with serve_app(create_app(str(directory), seed=0, **options)) as url:
        yield url


SHOT_A, SHOT_B = screenshot(640, 360, seed=1), screenshot(1280, 720, seed=2, fmt="JPEG")


def user_turn(text: str, *shots: bytes) -> dict:
    return {"role": "user", "content": [{"type": "text", "text": text}, *(image_part(s) for s in shots)]}


def placeholder_ids(tokenizer, messages) -> list[int]:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]


async def generate(client, url, ids, images, **extra) -> httpx.Response:
    body = {
        "input_ids": ids,
        "image_data": images,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        "return_prompt_token_ids": True,
        **extra,
    }
    return await client.post(f"{url}/generate", json=body)


# --- BaseMultimodalProcessor._expand_input_ids / resolve_image_token_counts ----------------------------


async def test_each_placeholder_expands_to_its_images_token_count(family):
    name, directory, tokenizer, processor = family
    messages = [user_turn("Compare these screens.", SHOT_A, SHOT_B)]
    reference = expanded_prompt(tokenizer, processor, messages)
    with emulator(directory) as url:
        async with httpx.AsyncClient(timeout=60) as client:
            answer = await generate(
                client, url, reference.placeholder_ids, [data_uri(SHOT_A), data_uri(SHOT_B, "JPEG")]
            )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["prompt_token_ids"] == reference.input_ids
    assert body["meta_info"]["prompt_tokens"] == len(reference.input_ids)
    assert body["meta_info"]["image_tokens"] == sum(reference.image_token_counts)
    assert reference.image_token_counts == {"qwen25_vl": [299, 1196], "qwen3_vl": [220, 880]}[name]


# --- TokenizerManager._tokenize_one_request: one item or a list; load_image: data URI or bare base64 --


async def test_image_data_is_one_item_or_a_list_of_data_uris_or_bare_base64(qwen25_vl):
    directory, tokenizer = qwen25_vl
    ids = placeholder_ids(tokenizer, [user_turn("Look.", SHOT_A)])
    with emulator(directory) as url:
        async with httpx.AsyncClient(timeout=60) as client:
            answers = [
                await generate(client, url, ids, image)
                for image in (data_uri(SHOT_A), [data_uri(SHOT_A)], base64.b64encode(SHOT_A).decode())
            ]
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert len({orjson.dumps(a.json()["prompt_token_ids"]) for a in answers}) == 1
    assert answers[0].json()["meta_info"]["image_tokens"] == 299


# --- load_mm_data and transformers' ProcessorMixin._check_special_mm_tokens: one pad per image -------


async def test_ids_already_expanded_are_refused_with_the_processors_message(qwen25_vl):
    directory, tokenizer = qwen25_vl
    ids = placeholder_ids(tokenizer, [user_turn("Look.", SHOT_A)])
    at = ids.index(PAD)
    expanded = ids[:at] + [PAD] * 299 + ids[at + 1 :]
    with emulator(directory) as url:
        async with httpx.AsyncClient(timeout=60) as client:
            answer = await generate(client, url, expanded, [data_uri(SHOT_A)])
    assert answer.status_code == 400
    assert answer.json()["error"]["message"] == (
        "The total number of <|image_pad|> tokens in the prompts should be the same as the number of "
        "images passed. Found total 299 <|image_pad|> tokens and 1 images."
    )


# --- BaseMultimodalProcessor.legacy_load_mm_data: blocks and images that do not pair up --------------


async def test_more_placeholders_than_images_fails_and_extra_images_are_dropped(qwen25_vl):
    directory, tokenizer = qwen25_vl
    two = placeholder_ids(tokenizer, [user_turn("Look.", SHOT_A, SHOT_A)])
    one = placeholder_ids(tokenizer, [user_turn("Look.", SHOT_A)])
    with emulator(directory) as url:
        async with httpx.AsyncClient(timeout=60) as client:
            missing = await generate(client, url, two, [data_uri(SHOT_A)])
            extra = await generate(client, url, one, [data_uri(SHOT_A), data_uri(SHOT_B, "JPEG")])
    # A block without its image: RuntimeError in the loader, which /generate does not map to a 400.
    assert (missing.status_code, missing.text) == (500, "Internal Server Error")
    # An image without a block is dropped with a warning: only the first is expanded.
    assert extra.status_code == 200 and extra.json()["meta_info"]["image_tokens"] == 299


# --- load_image: bytes that are not an image ----------------------------------------------------------


@pytest.mark.parametrize(
    "image", ["data:image/png;base64,not*base64", base64.b64encode(b"not an image").decode()]
)
async def test_an_image_that_does_not_load_fails_the_request(qwen25_vl, image):
    directory, tokenizer = qwen25_vl
    ids = placeholder_ids(tokenizer, [user_turn("Look.", SHOT_A)])
    with emulator(directory) as url:
        async with httpx.AsyncClient(timeout=60) as client:
            answer = await generate(client, url, ids, [image])
            still_serving = await generate(client, url, ids, [data_uri(SHOT_A)])
    assert (answer.status_code, answer.text) == (500, "Internal Server Error")
    assert still_serving.status_code == 200


# --- TokenizerManager._validate_one_request: the context length counts the expanded prompt -----------


async def test_context_length_counts_image_tokens(qwen25_vl):
    directory, tokenizer = qwen25_vl
    ids = placeholder_ids(tokenizer, [user_turn("Look.", SHOT_B)])
    with emulator(directory, context_length=len(ids) + 1000) as url:  # fits unexpanded, not expanded
        async with httpx.AsyncClient(timeout=60) as client:
            answer = await generate(client, url, ids, [data_uri(SHOT_B, "JPEG")])
    assert answer.status_code == 400
    assert answer.json()["error"]["message"].startswith(f"The input ({len(ids) - 1 + 1196} tokens) is longer")


# --- TokenizerManager._handle_batch_output: prompt_token_ids, image_tokens ---------------------------


async def test_prompt_token_ids_in_every_streamed_chunk_and_for_text_prompts(qwen25_vl):
    directory, tokenizer = qwen25_vl
    ids = placeholder_ids(tokenizer, [user_turn("Look.", SHOT_A)])
    text_ids = placeholder_ids(tokenizer, [{"role": "user", "content": "Just text."}])
    with emulator(directory) as url:
        async with httpx.AsyncClient(timeout=60) as client:
            streamed = await generate(client, url, ids, [data_uri(SHOT_A)], stream=True)
            text_only = await generate(client, url, text_ids, None)
            not_asked = await client.post(
                f"{url}/generate", json={"input_ids": text_ids, "sampling_params": {"max_new_tokens": 1}}
            )
    events = [line[len("data: ") :] for line in streamed.text.split("\n\n") if line.startswith("data: ")]
    chunks = [orjson.loads(event) for event in events[:-1]]
    assert events[-1] == "[DONE]" and len(chunks) == 4
    assert all(len(chunk["prompt_token_ids"]) == len(ids) - 1 + 299 for chunk in chunks)
    assert all(chunk["meta_info"]["image_tokens"] == 299 for chunk in chunks)
    assert text_only.json()["prompt_token_ids"] == text_ids
    assert "image_tokens" not in text_only.json()["meta_info"]
    assert "prompt_token_ids" not in not_asked.json()


# --- MultimodalDataItem.set_pad_value, pad_input_tokens: the prefix cache keys images by hash --------


async def test_prefix_cache_hits_a_repeated_screenshot_and_misses_a_changed_one(qwen25_vl):
    directory, tokenizer = qwen25_vl
    first = placeholder_ids(tokenizer, [user_turn("Open the menu.", SHOT_A)])
    with emulator(directory) as url:
        async with httpx.AsyncClient(timeout=60) as client:
            turn1 = (await generate(client, url, first, [data_uri(SHOT_A)])).json()
            output = turn1["output_ids"]
            follow = tokenizer.encode(
                "\n<|im_start|>user\nNext.<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n<|im_start|>assistant\n"
            )
            second = first + output + follow
            same = (await generate(client, url, second, [data_uri(SHOT_A), data_uri(SHOT_B, "JPEG")])).json()
            shot_c = screenshot(640, 360, seed=3)  # the same size: the same token count, another image
            changed = (
                await generate(client, url, second, [data_uri(shot_c), data_uri(SHOT_B, "JPEG")])
            ).json()
    expanded_first = turn1["prompt_token_ids"]
    # cache_finished_req kept (input + output)[:-1] of turn 1; turn 2 starts with all of it.
    assert same["meta_info"]["cached_tokens"] == len(expanded_first) + len(output) - 1
    assert same["prompt_token_ids"][: len(expanded_first)] == expanded_first
    # Another image of the same size: the same ids, but its run is keyed by another hash.
    assert changed["prompt_token_ids"] == same["prompt_token_ids"]
    assert changed["meta_info"]["cached_tokens"] == expanded_first.index(PAD)


async def test_the_reply_depends_on_the_image(qwen25_vl):
    """No vision encoder: the tiny model embeds a token drawn from each image's hash at its positions."""
    directory, tokenizer = qwen25_vl
    ids = placeholder_ids(tokenizer, [user_turn("Describe.", SHOT_A)])
    with emulator(directory) as url:
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"max_new_tokens": 8, "temperature": 0}
            answers = [
                (
                    await generate(
                        client, url, ids, [data_uri(shot)], sampling_params=body, return_logprob=True
                    )
                ).json()
                for shot in (SHOT_A, screenshot(640, 360, seed=9), SHOT_A)
            ]
    logprobs = [[entry[0] for entry in a["meta_info"]["output_token_logprobs"]] for a in answers]
    assert logprobs[0] == logprobs[2] != logprobs[1]


# --- process_and_combine_mm_data: SGLANG_MM_AVOID_RETOKENIZE keeps the caller's ids -------------------


async def test_callers_ids_are_kept_unless_avoid_retokenize_is_off(qwen25_vl, monkeypatch):
    directory, tokenizer = qwen25_vl
    ids = placeholder_ids(tokenizer, [user_turn("Hello", SHOT_A)])
    hello = tokenizer.encode("Hello", add_special_tokens=False)
    at = next(i for i in range(len(ids)) if ids[i : i + len(hello)] == hello)
    spelled = tokenizer.encode("H", add_special_tokens=False) + tokenizer.encode(
        "ello", add_special_tokens=False
    )
    assert len(spelled) > len(hello)
    odd = ids[:at] + spelled + ids[at + len(hello) :]  # not how the tokenizer would write it
    with emulator(directory) as url:
        async with httpx.AsyncClient(timeout=60) as client:
            kept = (await generate(client, url, odd, [data_uri(SHOT_A)])).json()
    monkeypatch.setenv("SGLANG_MM_AVOID_RETOKENIZE", "0")
    with emulator(directory) as url:
        async with httpx.AsyncClient(timeout=60) as client:
            drifted = (await generate(client, url, odd, [data_uri(SHOT_A)])).json()
    at_pad = odd.index(PAD)
    assert kept["prompt_token_ids"] == odd[:at_pad] + [PAD] * 299 + odd[at_pad + 1 :]
    assert drifted["prompt_token_ids"] == expanded_ids(ids, 299)  # re-tokenized: "Hello" is one token again


def expanded_ids(ids: list[int], count: int) -> list[int]:
    at = ids.index(PAD)
    return ids[:at] + [PAD] * count + ids[at + 1 :]


# --- sglang-router 0.3.2: image_data reaches the engine, return_prompt_token_ids does not ------------


@pytest.mark.router
async def test_the_real_router_passes_images_but_drops_return_prompt_token_ids(qwen25_vl, tmp_path):
    """The router re-serializes /generate through its typed GenerateRequest: `image_data` (a list or
    one item) is a field of it, `return_prompt_token_ids` is not, so behind the router the answer
    has no `prompt_token_ids`; `meta_info` (prompt_tokens, image_tokens) comes back unchanged. A
    client behind the router must take the expanded ids from the counts, not from the answer."""
    from rolloutfleet_testkit.routed_engines import routed_emulators

    directory, tokenizer = qwen25_vl
    ids = placeholder_ids(tokenizer, [user_turn("Look.", SHOT_A, SHOT_B)])
    one = placeholder_ids(tokenizer, [user_turn("Look.", SHOT_A)])
    images = [data_uri(SHOT_A), data_uri(SHOT_B, "JPEG")]
    with routed_emulators(directory, tmp_path, count=1) as (router_url, engines):
        async with httpx.AsyncClient(timeout=60) as client:
            routed = await generate(client, router_url, ids, images)
            direct = await generate(client, engines[0], ids, images)
            single = await generate(client, router_url, one, data_uri(SHOT_A))  # one item, not a list
    assert routed.status_code == direct.status_code == single.status_code == 200, routed.text
    assert "prompt_token_ids" not in routed.json()
    assert len(direct.json()["prompt_token_ids"]) == len(ids) - 2 + 299 + 1196
    for key, value in (("image_tokens", 299 + 1196), ("prompt_tokens", len(ids) - 2 + 299 + 1196)):
        assert routed.json()["meta_info"][key] == direct.json()["meta_info"][key] == value
    assert single.json()["meta_info"]["image_tokens"] == 299
