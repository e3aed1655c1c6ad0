"""Reference prompt ids for vision-language conversations, computed independently of the proxy and
of the SGLang emulator: the family's chat template renders the conversation (one
`<|vision_start|><|image_pad|><|vision_end|>` per image), the real vocabulary tokenizes it, and each
image's single pad is then expanded to the token count that transformers' own image processor gives
that image with the model directory's `preprocessor_config.json` (the processor SGLang runs).

    processor = image_processor(model_dir)
    prompt = expanded_prompt(tokenizer, processor, messages, tools=None)
    prompt.placeholder_ids   # what a client sends SGLang with image_data: one pad per image
    prompt.input_ids         # what SGLang answers with return_prompt_token_ids: each pad expanded
    prompt.image_grid_thw    # per image (t, h, w) in patches; tokens = t * h * w / merge_size**2
    conversation_prompt(tokenizer, processor, messages, replies, outputs)  # with the model's own reply ids

Shared by the tests that check recorded ids against a real SGLang's.
"""

from __future__ import annotations

import base64
import io
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass

IMAGE_PAD_ID = 151655  # <|image_pad|> in Qwen's vocabulary (Qwen2-VL, Qwen2.5-VL, Qwen3-VL)


# A computer-use agent's tool, for conversations with tool calls and results.
CLICK = {
    "type": "function",
    "function": {
        "name": "click",
        "description": "Click at a point of the screen",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
    },
}


@dataclass(frozen=True)
class ImagePrompt:
    placeholder_ids: list[int]
    input_ids: list[int]
    image_grid_thw: list[tuple[int, int, int]]
    image_token_counts: list[int]


def image_processor(model_dir: str | pathlib.Path):
    """transformers' image processor for the directory's preprocessor_config.json (PIL backend: no
    torch needed)."""
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(str(model_dir), backend="pil", local_files_only=True)


def decode_image_url(url: str) -> bytes:
    """The bytes of a `data:image/...;base64,` URI or of bare base64."""
    payload = url.split(",", 1)[1] if url.startswith("data:") else url
    return base64.b64decode(payload, validate=True)


def message_images(messages: Sequence[dict]) -> list[bytes]:
    """Every image of the conversation, in the order the template renders them (message by message,
    part by part): `image_url` parts and `image` parts holding a data URI or base64."""
    images = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            if part.get("type") == "image_url":
                images.append(decode_image_url(part["image_url"]["url"]))
            elif part.get("type") == "image":
                images.append(decode_image_url(part["image"]))
    return images


def image_grids(processor, images: Sequence[bytes]) -> list[tuple[int, int, int]]:
    """Each image's (t, h, w) grid as the processor computes it (it decodes, converts to RGB,
    resizes with smart_resize and patches the image)."""
    from PIL import Image

    grids = []
    for data in images:
        with Image.open(io.BytesIO(data)) as opened:
            rgb = opened.convert("RGB")
        (grid,) = processor(images=[rgb])["image_grid_thw"].tolist()
        grids.append((int(grid[0]), int(grid[1]), int(grid[2])))
    return grids


def token_count(processor, grid: tuple[int, int, int]) -> int:
    t, h, w = grid
    return t * h * w // processor.merge_size**2


def expand_pads(ids: Sequence[int], counts: Sequence[int], pad_id: int = IMAGE_PAD_ID) -> list[int]:
    """`ids` with the i-th single pad repeated counts[i] times; refuses ids whose pads are not one
    per image."""
    if sum(1 for token in ids if token == pad_id) != len(counts):
        raise ValueError(f"{sum(1 for t in ids if t == pad_id)} pads for {len(counts)} images")
    expanded: list[int] = []
    remaining = iter(counts)
    for token in ids:
        expanded.extend([token] * next(remaining) if token == pad_id else [token])
    return expanded


def expanded_prompt(
    tokenizer, processor, messages: Sequence[dict], tools=None, **template_kwargs
) -> ImagePrompt:
    """The conversation's generation prompt: rendered, tokenized, each image's pad expanded."""
    text = tokenizer.apply_chat_template(
        list(messages), tools=tools, tokenize=False, add_generation_prompt=True, **template_kwargs
    )
    placeholder_ids = tokenizer.encode(text, add_special_tokens=False)
    grids = image_grids(processor, message_images(messages))
    counts = [token_count(processor, grid) for grid in grids]
    return ImagePrompt(
        placeholder_ids=placeholder_ids,
        input_ids=expand_pads(placeholder_ids, counts),
        image_grid_thw=grids,
        image_token_counts=counts,
    )


def conversation_prompt(
    tokenizer,
    processor,
    messages: Sequence[dict],
    replies: Sequence[int],
    outputs: Sequence[list[int]],
    tools=None,
) -> list[int]:
    """The generation prompt after `messages` as the template renders the whole conversation, with
    the model's replies (the messages at indexes `replies`) as the ids it generated (`outputs`), not
    their text re-tokenized (decoding and re-encoding a sampled token need not give it back), and
    each image placeholder expanded by the processor. A reply's text is a marker in the rendering;
    the text between markers is tokenized piece by piece (what the template writes around a reply)."""
    marked = [
        dict(m, content=f"rfreplymarker{list(replies).index(i)}") if i in replies else m
        for i, m in enumerate(messages)
    ]
    text = tokenizer.apply_chat_template(marked, tools=tools, tokenize=False, add_generation_prompt=True)
    ids: list[int] = []
    for index in range(len(replies)):
        before, text = text.split(f"rfreplymarker{index}", 1)
        ids += tokenizer.encode(before, add_special_tokens=False) + list(outputs[index])
    ids += tokenizer.encode(text, add_special_tokens=False)
    counts = expanded_prompt(tokenizer, processor, messages, tools=tools).image_token_counts
    return expand_pads(ids, counts)
