"""Images on `/generate` with `input_ids`, as SGLang's Qwen-VL path takes them (a TEST STAND-IN: no
vision encoder; an image only decides how many tokens it takes and what the prefix cache keys them by).

Each rule follows a named piece of SGLang's source (read, not copied):
- `TokenizerManager._tokenize_one_request`: `image_data` is one item or a list; the multimodal
  processor's `input_ids` replace the request's, and the context-length check
  (`_validate_one_request`) counts the expanded ids.
- `BaseMultimodalProcessor.load_mm_data` (multimodal/processors/base_processor.py): the prompt is
  decoded and split on image blocks (`<|vision_start|>(<|image_pad|>)+<|vision_end|>`, the Qwen-VL
  processor's `image_token_regex`). As many blocks as images: the fast path, the decoded text goes to
  the HF processor as it is. Otherwise `legacy_load_mm_data`: more blocks than images fails
  (`RuntimeError("An exception occurred while loading multimodal data: ")`, HTTP 500); fewer keeps the
  first images (the rest are dropped with a warning) and rewrites each block as one placeholder.
- `load_image` / `_load_single_item`: a data URI or bare base64; bytes that do not decode to an image
  fail the request (`RuntimeError`, HTTP 500).
- transformers' `ProcessorMixin._check_special_mm_tokens`: the text must hold as many
  `<|image_pad|>` as there are images, else `ValueError("The total number of <|image_pad|> tokens in
  the prompts should be the same as the number of images passed. ...")`, which SGLang's `/generate`
  answers with HTTP 400: ids that are already expanded, sent with their images, land here.
- `process_and_combine_mm_data` with `SGLANG_MM_AVOID_RETOKENIZE` (on by default): the caller's ids
  are kept and the i-th pad is repeated as many times as the i-th image has tokens
  (`_expand_input_ids`, counts from `resolve_image_token_counts`, i.e. the image processor's
  `get_number_of_image_patches` / merge_size**2 for the image's size). When the ids' pads do not match
  the images one to one (or the variable is off) SGLang falls back to decoding and re-tokenizing
  the processor's text (a warning: "token drift").
- `MultimodalDataItem.set_pad_value` and the model's `pad_input_ids` (managers/mm_utils.py,
  `MultiModalityDataPaddingPatternMultimodalTokens.pad_input_tokens`): for the radix cache each
  image's token run is replaced by a value from the image's hash (`hash % (1 << 30)`), so a
  repeated image hits the prefix cache and a changed one misses. SGLang hashes the processed pixel
  values; the emulator hashes the decoded image bytes (equal images, equal bytes, in every test).
- `TokenizerManager._handle_batch_output`: `meta_info.image_tokens` is the request's image token
  count (only when it has any); with `return_prompt_token_ids` the answer carries the expanded
  `prompt_token_ids` at the top level.
"""

from __future__ import annotations

import base64
import binascii
import collections
import hashlib
import io
import json
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .protocol import BadRequest, ServerError

AVOID_RETOKENIZE_ENV = "SGLANG_MM_AVOID_RETOKENIZE"
PAD_VALUE_MODULUS = 1 << 30
IMAGE_CACHE_ENTRIES = 4096  # distinct images whose grid is remembered (a decode each otherwise)


@dataclass(frozen=True)
class VisionTokens:
    """The ids SGLang's Qwen-VL processor reads from config.json."""

    vision_start: int
    vision_end: int
    image_pad: int


@dataclass(frozen=True)
class Image:
    digest: bytes  # sha256 of the decoded bytes
    grid: tuple[int, int, int]  # (t, h, w) in patches
    tokens: int  # t * h * w / merge_size**2

    @property
    def pad_value(self) -> int:
        return int.from_bytes(self.digest[:8], "big") % PAD_VALUE_MODULUS


@dataclass(frozen=True)
class ImagePrompt:
    """A prompt with its images: what the engine runs, answers and caches."""

    input_ids: list[int]  # expanded: what prompt_token_ids and prompt_tokens report
    cache_ids: list[int]  # input_ids with each image's run replaced by its pad value (radix keys)
    image_tokens: int


def decode_image_data(item: object) -> bytes:
    """An `image_data` entry's bytes: a `data:...;base64,` URI or bare base64 (`load_image`)."""
    if not isinstance(item, str):
        raise BadRequest("image_data entries must be strings (data URIs or base64)")
    payload = item.split(",", 1)[1] if item.startswith("data:") else item
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ServerError(f"An exception occurred while loading IMAGE data: {exc}") from None


def image_data_list(value: object) -> list[object]:
    """`image_data` as a list (`_tokenize_one_request` wraps a single item)."""
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def image_blocks(ids: Sequence[int], tokens: VisionTokens) -> list[tuple[int, int]]:
    """(start, end) of every `vision_start pad+ vision_end` run, end exclusive."""
    blocks, i = [], 0
    while i < len(ids):
        if ids[i] == tokens.vision_start:
            j = i + 1
            while j < len(ids) and ids[j] == tokens.image_pad:
                j += 1
            if j > i + 1 and j < len(ids) and ids[j] == tokens.vision_end:
                blocks.append((i, j + 1))
                i = j + 1
                continue
        i += 1
    return blocks


def _canonical(ids: Sequence[int], blocks: list[tuple[int, int]], tokens: VisionTokens) -> list[int]:
    """ids with each block rewritten as one placeholder (what `legacy_load_mm_data` writes)."""
    out: list[int] = []
    last = 0
    for start, end in blocks:
        out += [*ids[last:start], tokens.vision_start, tokens.image_pad, tokens.vision_end]
        last = end
    return out + list(ids[last:])


def expand_pads(ids: Sequence[int], counts: Sequence[int], pad: int) -> list[int]:
    """`_expand_input_ids`: the i-th pad repeated counts[i] times (pads and counts match)."""
    expanded: list[int] = []
    remaining = iter(counts)
    for token in ids:
        if token == pad:
            expanded += [pad] * next(remaining)
        else:
            expanded.append(token)
    return expanded


def cache_keys(expanded: Sequence[int], images: Sequence[Image], pad: int) -> list[int]:
    """`pad_input_tokens`: each run of pads carries its image's pad value, in order."""
    keys = list(expanded)
    image_runs = iter(images)
    i = 0
    while i < len(keys):
        if keys[i] == pad:
            j = i
            while j < len(keys) and keys[j] == pad:
                j += 1
            value = next(image_runs).pad_value
            keys[i:j] = [value] * (j - i)
            i = j
        else:
            i += 1
    return keys


def build_prompt(
    input_ids: list[int],
    images: list[Image],
    tokens: VisionTokens,
    retokenize,
    avoid_retokenize: bool = True,
) -> tuple[ImagePrompt, list[Image]]:
    """The expanded prompt SGLang makes of `input_ids` and its images, and the images it used.

    `retokenize(ids) -> ids` is decode-then-encode with the model's tokenizer (the fallback path).
    """
    blocks = image_blocks(input_ids, tokens)
    if len(blocks) > len(images):  # legacy_load_mm_data: a block without data
        raise ServerError("An exception occurred while loading multimodal data: ")
    fast_path = len(blocks) == len(images)
    used = images[: len(blocks)]
    # The text the HF processor gets: the decoded ids (fast path) or each block as one placeholder.
    text_ids = input_ids if fast_path else _canonical(input_ids, blocks, tokens)
    pads_in_text = sum(1 for token in text_ids if token == tokens.image_pad)
    if pads_in_text != len(used):
        raise BadRequest(
            "The total number of <|image_pad|> tokens in the prompts should be the same as the number "
            f"of images passed. Found total {pads_in_text} <|image_pad|> tokens and {len(used)} images."
        )
    counts = [image.tokens for image in used]
    pads_in_ids = sum(1 for token in input_ids if token == tokens.image_pad)
    if avoid_retokenize and pads_in_ids == len(used):
        expanded = expand_pads(input_ids, counts, tokens.image_pad)
    else:  # "falling back to decode+retokenize, which may change prompt length (token drift)"
        expanded = expand_pads(retokenize(text_ids), counts, tokens.image_pad)
    prompt = ImagePrompt(
        input_ids=expanded,
        cache_ids=cache_keys(expanded, used, tokens.image_pad),
        image_tokens=sum(counts),
    )
    return prompt, used


class ImageReader:
    """Images to (digest, grid, tokens) with the model directory's image processor, remembering the
    grids of recent distinct images (SGLang's `--mm-preprocess-cache-size-mb` does the same for
    processed images) so a history's repeated screenshots are decoded once."""

    def __init__(self, model_dir: str | os.PathLike):
        from transformers import AutoImageProcessor

        directory = Path(model_dir)
        config = json.loads((directory / "config.json").read_text())
        self.tokens = VisionTokens(
            vision_start=int(config["vision_start_token_id"]),
            vision_end=int(config["vision_end_token_id"]),
            image_pad=int(config["image_token_id"]),
        )
        self.processor = AutoImageProcessor.from_pretrained(
            str(directory), backend="pil", local_files_only=True
        )
        self._grids: collections.OrderedDict[bytes, tuple[int, int, int]] = collections.OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def serves(model_dir: str | os.PathLike) -> bool:
        """True for a vision-language model directory (config.json with an image token, and a
        preprocessor_config.json), as SGLang picks a multimodal processor by the architecture."""
        directory = Path(model_dir)
        try:
            config = json.loads((directory / "config.json").read_text())
        except (OSError, ValueError):
            return False
        return "image_token_id" in config and (directory / "preprocessor_config.json").is_file()

    def _grid(self, data: bytes) -> tuple[int, int, int]:
        from PIL import Image as PilImage
        from PIL import UnidentifiedImageError
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        try:
            with PilImage.open(io.BytesIO(data)) as opened:
                opened.load()  # a truncated image fails here, as SGLang's loader does
                width, height = opened.size
        except (UnidentifiedImageError, OSError, ValueError) as exc:
            raise ServerError(f"An exception occurred while loading IMAGE data: {exc}") from None
        processor = self.processor
        factor = processor.patch_size * processor.merge_size
        try:
            resized_h, resized_w = smart_resize(
                height, width, factor, processor.size.shortest_edge, processor.size.longest_edge
            )
        except ValueError as exc:  # an aspect ratio over 200
            raise BadRequest(str(exc)) from None
        patches = processor.get_number_of_image_patches(height, width)
        grid = (1, resized_h // processor.patch_size, resized_w // processor.patch_size)
        assert grid[1] * grid[2] == patches
        return grid

    def read(self, data: bytes) -> Image:
        digest = hashlib.sha256(data).digest()
        with self._lock:
            grid = self._grids.get(digest)
            if grid is not None:
                self._grids.move_to_end(digest)
        if grid is None:
            grid = self._grid(data)
            with self._lock:
                self._grids[digest] = grid
                while len(self._grids) > IMAGE_CACHE_ENTRIES:
                    self._grids.popitem(last=False)
        merge = self.processor.merge_size
        return Image(digest=digest, grid=grid, tokens=grid[0] * grid[1] * grid[2] // (merge * merge))
