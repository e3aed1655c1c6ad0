"""The vision-language model directories (Qwen2.5-VL, Qwen3-VL), the synthetic screenshots and the
reference expansion of image placeholders (tests/vl_reference.py).

Expected renderings and token counts are written out by hand from the families' formats and from
the processor's resizing rule, never taken from the code under test.
"""

from __future__ import annotations

import functools
import io
import json
import math

import pytest
from rolloutfleet_testkit.model_families import (
    IMAGE_PLACEHOLDER,
    VISION_TOKEN_IDS,
    VL_FAMILIES,
    VL_FAMILY_NAMES,
    family_cache_dir,
)
from rolloutfleet_testkit.screenshots import data_uri, image_part, screenshot
from vl_reference import expand_pads, expanded_prompt, image_grids, image_processor, message_images

PLACEHOLDER_IDS = [151652, 151655, 151653]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "click",
        "description": "Click at a point of the screen",
        "parameters": {
            "type": "object",
            "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
            "required": ["x", "y"],
        },
    },
}
HERMES_TOOLS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    f"{json.dumps(WEATHER_TOOL, ensure_ascii=False)}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
CLICK = '<tool_call>\n{"name": "click", "arguments": {"x": 10, "y": 20}}\n</tool_call>'


@pytest.fixture(scope="session")
def vl_dirs():
    return {name: VL_FAMILIES[name].build_cached() for name in VL_FAMILY_NAMES}


@pytest.fixture(scope="session")
def load(vl_dirs):
    from transformers import AutoTokenizer

    @functools.cache
    def load_family(name: str):
        return AutoTokenizer.from_pretrained(str(vl_dirs[name]), local_files_only=True)

    return load_family


@pytest.fixture(scope="session")
def processors(vl_dirs):
    return {name: image_processor(vl_dirs[name]) for name in VL_FAMILY_NAMES}


def conversation(first: bytes, second: bytes) -> list[dict]:
    """A computer-use exchange: a screenshot in the user turn, a click, a screenshot as its result."""
    return [
        {"role": "user", "content": [{"type": "text", "text": "Open the menu."}, image_part(first)]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "click", "arguments": {"x": 10, "y": 20}},
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "c1",
            "content": [{"type": "text", "text": "clicked"}, image_part(second, "JPEG")],
        },
    ]


@pytest.mark.parametrize("name", VL_FAMILY_NAMES)
def test_model_directory_loads_offline_with_the_vision_tokens_at_their_real_ids(name, vl_dirs, load):
    from transformers import AutoConfig

    directory = vl_dirs[name]
    assert directory == family_cache_dir(name)
    tokenizer = load(name)
    assert len(tokenizer) == {"qwen25_vl": 151665, "qwen3_vl": 151669}[name]
    assert tokenizer.convert_tokens_to_ids(
        ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    ) == [
        151652,
        151653,
        151655,
        151656,
    ]
    assert dict(VISION_TOKEN_IDS) == {
        "<|vision_start|>": 151652,
        "<|vision_end|>": 151653,
        "<|image_pad|>": 151655,
        "<|video_pad|>": 151656,
    }
    assert tokenizer.encode(IMAGE_PLACEHOLDER, add_special_tokens=False) == PLACEHOLDER_IDS
    # transformers reads config.json as the family's own configuration class (as SGLang does).
    config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    assert (config.model_type, config.architectures) == (
        {"qwen25_vl": "qwen2_5_vl", "qwen3_vl": "qwen3_vl"}[name],
        [
            {
                "qwen25_vl": "Qwen2_5_VLForConditionalGeneration",
                "qwen3_vl": "Qwen3VLForConditionalGeneration",
            }[name]
        ],
    )
    assert (config.image_token_id, config.video_token_id, config.vision_start_token_id) == (
        151655,
        151656,
        151652,
    )
    assert config.vision_config.spatial_merge_size == 2
    assert config.vision_config.patch_size == {"qwen25_vl": 14, "qwen3_vl": 16}[name]


def test_preprocessor_configs_are_the_familys(processors):
    qwen25, qwen3 = processors["qwen25_vl"], processors["qwen3_vl"]
    assert type(qwen25).__name__ == type(qwen3).__name__ == "Qwen2VLImageProcessorPil"
    assert (qwen25.patch_size, qwen25.merge_size, qwen25.temporal_patch_size) == (14, 2, 2)
    assert (qwen25.size.shortest_edge, qwen25.size.longest_edge) == (56 * 56, 28 * 28 * 16384)
    assert list(qwen25.image_mean) == [0.48145466, 0.4578275, 0.40821073]
    assert (qwen3.patch_size, qwen3.merge_size, qwen3.temporal_patch_size) == (16, 2, 2)
    assert (qwen3.size.shortest_edge, qwen3.size.longest_edge) == (256 * 256, 4096 * 4096)
    assert list(qwen3.image_mean) == list(qwen3.image_std) == [0.5, 0.5, 0.5]


def by_hand(width: int, height: int, patch: int) -> tuple[int, int, int]:
    """smart_resize within the bounds: each side rounded (half to even) to a multiple of patch * 2."""
    factor = patch * 2
    return (1, round(height / factor) * factor // patch, round(width / factor) * factor // patch)


@pytest.mark.parametrize(
    ("name", "size", "grid", "tokens"),
    [
        ("qwen25_vl", (640, 360), (1, 26, 46), 299),
        ("qwen25_vl", (1280, 720), (1, 52, 92), 1196),
        ("qwen3_vl", (640, 360), (1, 22, 40), 220),
        ("qwen3_vl", (1280, 720), (1, 44, 80), 880),  # 720 / 32 = 22.5 rounds to 22
    ],
)
def test_screenshot_token_counts(name, size, grid, tokens, processors):
    processor = processors[name]
    assert grid == by_hand(*size, processor.patch_size)
    for fmt in ("PNG", "JPEG"):
        assert image_grids(processor, [screenshot(*size, seed=4, fmt=fmt)]) == [grid]
    assert math.prod(grid) // 4 == tokens
    # transformers' own count (what SGLang's resolve_image_token_counts asks the processor for).
    assert processor.get_number_of_image_patches(size[1], size[0]) // 4 == tokens


def test_screenshots_are_deterministic_and_differ_by_seed():
    from PIL import Image

    png = screenshot(1280, 720, seed=7)
    assert png == screenshot(1280, 720, seed=7) != screenshot(1280, 720, seed=8)
    assert 100_000 < len(png) < 1_000_000  # weighs what a real 1280x720 PNG screenshot weighs
    for fmt, data in (("PNG", png), ("JPEG", screenshot(640, 360, seed=7, fmt="JPEG"))):
        with Image.open(io.BytesIO(data)) as image:
            assert image.format == fmt
    with Image.open(io.BytesIO(png)) as image:
        assert (image.size, image.mode) == ((1280, 720), "RGB")
    assert data_uri(b"\x89PNG").startswith("data:image/png;base64,")
    with pytest.raises(ValueError):
        screenshot(640, 360, fmt="GIF")


@pytest.mark.parametrize("name", VL_FAMILY_NAMES)
def test_template_renders_one_placeholder_per_image_in_user_and_tool_messages(name, load):
    first, second = screenshot(640, 360, seed=1), screenshot(640, 360, seed=2, fmt="JPEG")
    rendered = load(name).apply_chat_template(
        conversation(first, second), tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True
    )
    system = {"qwen25_vl": "You are a helpful assistant.\n\n", "qwen3_vl": ""}[name]
    call_line = {"qwen25_vl": "<|im_start|>assistant\n", "qwen3_vl": "<|im_start|>assistant\n"}[name]
    assert rendered == (
        f"<|im_start|>system\n{system}{HERMES_TOOLS}<|im_end|>\n"
        f"<|im_start|>user\nOpen the menu.{IMAGE_PLACEHOLDER}<|im_end|>\n"
        f"{call_line}{CLICK}<|im_end|>\n"
        f"<|im_start|>user\n<tool_response>\nclicked{IMAGE_PLACEHOLDER}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_qwen25_vl_default_system_prompt_and_image_only_content(load):
    messages = [
        {"role": "user", "content": [image_part(screenshot(64, 64)), {"type": "image", "image": "AAAA"}]}
    ]
    assert load("qwen25_vl").apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        f"<|im_start|>user\n{IMAGE_PLACEHOLDER}{IMAGE_PLACEHOLDER}<|im_end|>\n<|im_start|>assistant\n"
    )
    assert load("qwen3_vl").apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        f"<|im_start|>user\n{IMAGE_PLACEHOLDER}{IMAGE_PLACEHOLDER}<|im_end|>\n<|im_start|>assistant\n"
    )


def test_replies_are_the_text_families_formats():
    assert VL_FAMILIES["qwen3_vl"].model_reply_text(None, "Done.", [("click", {"x": 10, "y": 20})]) == (
        f"Done.\n{CLICK}<|im_end|>"
    )
    assert VL_FAMILIES["qwen25_vl"].model_reply_text(None, "Done.") == "Done.<|im_end|>"
    with pytest.raises(ValueError):
        VL_FAMILIES["qwen3_vl"].model_reply_text("thinking", "Done.")


@pytest.mark.parametrize(("name", "counts"), [("qwen25_vl", [299, 1196]), ("qwen3_vl", [220, 880])])
def test_reference_expands_each_placeholder_to_its_images_token_count(name, counts, load, processors):
    tokenizer = load(name)
    first, second = screenshot(640, 360, seed=1), screenshot(1280, 720, seed=2, fmt="JPEG")
    messages = conversation(first, second)
    assert message_images(messages) == [first, second]
    prompt = expanded_prompt(tokenizer, processors[name], messages, tools=[WEATHER_TOOL])
    assert prompt.image_token_counts == counts
    assert prompt.image_grid_thw == [
        by_hand(640, 360, processors[name].patch_size),
        by_hand(1280, 720, processors[name].patch_size),
    ]
    assert (
        prompt.placeholder_ids
        == tokenizer.apply_chat_template(
            messages, tools=[WEATHER_TOOL], tokenize=True, add_generation_prompt=True
        )["input_ids"]
    )
    # Each image block is vision_start, count pads, vision_end; the text around it is untouched.
    ids = prompt.input_ids
    assert len(ids) == len(prompt.placeholder_ids) + sum(counts) - 2
    starts = [i for i, token in enumerate(ids) if token == 151652]
    assert [
        ids[s + 1 : s + 1 + c] == [151655] * c and ids[s + 1 + c] == 151653
        for s, c in zip(starts, counts, strict=True)
    ] == [True, True]
    collapsed = [t for i, t in enumerate(ids) if t != 151655 or ids[i - 1] != 151655]
    assert collapsed == prompt.placeholder_ids


def test_expand_pads_requires_one_pad_per_image():
    assert expand_pads([1, 151655, 2, 151655], [2, 3]) == [1, 151655, 151655, 2, 151655, 151655, 151655]
    with pytest.raises(ValueError, match="2 pads for 1 images"):
        expand_pads([151655, 151655], [4])
