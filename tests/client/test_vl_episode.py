"""A vision-language episode reaches the frameworks with its images: a screenshot agent (the official
`openai` client on the session's capability URL) in front of a real proxy and the SGLang emulator (a
test stand-in for a GPU engine, taking images as SGLang's Qwen-VL path does) with a Qwen2.5-VL model
directory; `FleetClient.take` hands back each image's bytes, `Episode` keeps them in prompt order with
their token runs, and the slime/miles and AReaL shapes carry what those frameworks' own VLM rollouts
carry. Every figure is compared with an independent reference: transformers' image processor applied
to the bytes the agent sent, and the template-rendered, expanded prompt of `vl_reference`."""

from __future__ import annotations

import asyncio
import hashlib
import json

import pytest
import torch
from openai import AsyncOpenAI
from proxy_harness import ADMIN_KEY, running_proxy
from rolloutfleet_client.adapters import Episode, FleetConfig, episode_from_sample, run_episode
from rolloutfleet_client.adapters.slime import multimodal_fields
from rolloutfleet_testkit.model_families import VL_FAMILIES
from rolloutfleet_testkit.processes import serve_app
from rolloutfleet_testkit.screenshots import image_part, screenshot
from rolloutfleet_testkit.sglang_emulator.server import create_app as emulator_app
from transformers import AutoTokenizer
from vl_reference import IMAGE_PAD_ID, expanded_prompt, image_processor

SHOTS = [screenshot(640, 360, seed=40), screenshot(320, 640, seed=41)]


@pytest.fixture(scope="module")
def model_dir():
    return VL_FAMILIES["qwen25_vl"].build_cached()


async def screenshot_agent(run) -> float:
    """Two steps, a new screenshot each, the first shown again in the last: three images in all."""
    client = AsyncOpenAI(base_url=run.base_url, api_key=run.api_key, max_retries=0)
    messages: list[dict] = []
    for step, shot in enumerate([*SHOTS, SHOTS[0]]):
        messages.append(
            {"role": "user", "content": [{"type": "text", "text": f"Step {step}"}, image_part(shot)]}
        )
        reply = await client.chat.completions.create(
            model="policy", messages=messages, max_tokens=3, temperature=0
        )
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
    await client.close()
    return 1.0


@pytest.fixture(scope="module")
def episode(model_dir, tmp_path_factory) -> Episode:
    dumps = tmp_path_factory.mktemp("vl-episode-dumps")
    with (
        serve_app(emulator_app(str(model_dir), seed=0)) as engine,
        running_proxy(engine, model_dir, dumps) as proxy,
    ):

        async def run() -> Episode:
            async with FleetConfig(ADMIN_KEY, [proxy.url]).client() as fleet:
                return await run_episode(fleet, screenshot_agent)

        return asyncio.run(run())


def test_an_episode_keeps_every_image_in_prompt_order_with_its_token_run(episode, model_dir):
    sent = [*SHOTS, SHOTS[0]]
    assert [image.data for image in episode.images] == sent
    assert [image.sha256 for image in episode.images] == [hashlib.sha256(s).hexdigest() for s in sent]
    processor = image_processor(model_dir)
    for image, shot in zip(episode.images, sent, strict=True):
        grid = processor(images=[episode_image_rgb(shot)], return_tensors="np")["image_grid_thw"][0].tolist()
        assert list(image.grid_thw) == grid
        assert image.tokens == grid[0] * grid[1] * grid[2] // 4  # merge size 2
        assert episode.tokens[image.offset : image.offset + image.tokens] == [IMAGE_PAD_ID] * image.tokens
    # Nothing but the images' runs is image tokens, and every run is a whole run.
    mask = episode.image_token_mask()
    assert sum(mask) == sum(image.tokens for image in episode.images)
    assert all((token == IMAGE_PAD_ID) == bool(m) for token, m in zip(episode.tokens, mask, strict=True))
    assert episode.processor_config == json.loads((model_dir / "preprocessor_config.json").read_text())
    assert episode.reward == 1.0 and episode.num_turns == 3


def test_the_episode_prompt_is_the_template_rendered_expanded_prompt(episode, model_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    first = [{"role": "user", "content": [{"type": "text", "text": "Step 0"}, image_part(SHOTS[0])]}]
    reference = expanded_prompt(tokenizer, image_processor(model_dir), first)
    assert episode.prompt_ids == reference.input_ids


def test_image_inputs_are_the_processors_of_the_sent_bytes(episode, model_dir):
    inputs = episode.image_inputs()
    processor = image_processor(model_dir)
    expected = [processor(images=[episode_image_rgb(s)], return_tensors="np") for s in [*SHOTS, SHOTS[0]]]
    assert inputs["image_grid_thw"].tolist() == [e["image_grid_thw"][0].tolist() for e in expected]
    reference = torch.cat([torch.from_numpy(e["pixel_values"]).float() for e in expected])
    assert inputs["pixel_values"].shape == reference.shape
    assert torch.allclose(inputs["pixel_values"], reference, atol=1e-5)


def test_slime_gets_the_raw_images_and_the_train_inputs_as_its_vlm_rollouts_fill_them(episode):
    fields = multimodal_fields(episode)
    images = fields["multimodal_inputs"]["images"]
    sizes = [(640, 360), (320, 640), (640, 360)]
    assert [(i.mode, i.size) for i in images] == [("RGB", size) for size in sizes]
    train = fields["multimodal_train_inputs"]
    assert set(train) == {"pixel_values", "image_grid_thw"}
    assert train["image_grid_thw"].tolist() == [list(i.grid_thw) for i in episode.images]


def test_a_changed_processor_configuration_is_refused_not_trained_on(episode, model_dir):
    from rolloutfleet_client.trainer import image_processor_for

    other = {**episode.processor_config, "max_pixels": 64 * 28 * 28}  # fewer tokens than the engine made
    with pytest.raises(ValueError, match="another processor configuration than the engine's"):
        episode.image_inputs(image_processor_for(other))


def test_a_sample_without_image_bytes_is_a_clear_error():
    sample = {
        "session_id": "s",
        "input_ids": [1, 2, 3],
        "turn_bounds": [[1, 3]],
        "loss_mask": [0, 1, 1],
        "logprobs": [0.0, -0.1, -0.2],
        "versions": [-1, 0, 0],
        "images": [{"offset": 0, "tokens": 1, "grid_thw": [1, 2, 2], "sha256": "00" * 32}],
    }
    with pytest.raises(ValueError, match=r"FleetClient\.take"):
        episode_from_sample(sample)


def episode_image_rgb(data: bytes):
    import io

    from PIL import Image

    with Image.open(io.BytesIO(data)) as opened:
        return opened.convert("RGB")
