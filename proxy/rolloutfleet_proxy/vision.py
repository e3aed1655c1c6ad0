"""A vision-language model directory: the image token, and how many of them an image becomes.

Read from the model directory as SGLang reads it, so nothing is set by hand: `preprocessor_config.json`
(the image processor: patch size, merge size, min and max pixels) and `config.json` (`image_token_id`).
An image of W x H pixels is resized by transformers' own `smart_resize` of the family (multiples of
patch * merge, within [min_pixels, max_pixels]); its grid (t, h, w) counts patches, and the engine
expands its single placeholder to t * h * w / merge**2 tokens. The proxy predicts that count (to place
a request in its session's tree before the engine answers) and checks it against what SGLang expands.

A directory without `preprocessor_config.json` is a text model: requests with images are refused.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PREPROCESSOR_CONFIG = "preprocessor_config.json"
# Qwen's vocabulary names the image placeholder so; config.json's image_token_id wins when present.
IMAGE_PAD = "<|image_pad|>"


class VisionConfigError(ValueError):
    """The model directory's image configuration cannot be used (the proxy refuses to start)."""


@dataclass(frozen=True)
class VisionModel:
    image_token_id: int
    patch_size: int
    merge_size: int
    processor_config: dict[str, Any]  # preprocessor_config.json as the directory has it (for exports)
    _processor: Any
    _resize: Any

    def grid(self, width: int, height: int) -> tuple[int, int, int]:
        """The image's grid (t, h, w) in patches, as the family's image processor computes it."""
        size = self._processor.size
        factor = self.patch_size * self.merge_size
        resized_h, resized_w = self._resize(
            height, width, factor, min_pixels=size.shortest_edge, max_pixels=size.longest_edge
        )
        return (1, resized_h // self.patch_size, resized_w // self.patch_size)

    def tokens(self, grid: tuple[int, int, int]) -> int:
        t, h, w = grid
        return t * h * w // (self.merge_size * self.merge_size)

    def check(self) -> None:
        """The grid agrees with the processor's own patch count (a processor this module misreads
        is refused at start, not on a turn)."""
        for width, height in ((1280, 720), (640, 360), (37, 1000)):
            _, h, w = self.grid(width, height)
            expected = self._processor.get_number_of_image_patches(height, width)
            if h * w != expected:
                raise VisionConfigError(
                    f"the image processor counts {expected} patches for {width}x{height}, the grid {h}x{w}"
                )


def takes_images(model_dir: str | os.PathLike) -> bool:
    """Whether the model directory is a vision-language model's (it has an image processor)."""
    return (Path(model_dir) / PREPROCESSOR_CONFIG).is_file()


def load_vision_model(model_dir: str | os.PathLike, tokenizer: Any) -> VisionModel:
    """The directory's vision configuration (it `takes_images`); VisionConfigError when unusable."""
    directory = Path(model_dir)
    try:
        processor_config = json.loads((directory / PREPROCESSOR_CONFIG).read_text())
        # The proxy runs without torch: transformers then picks the PIL/numpy processor.
        from transformers import AutoImageProcessor

        processor = AutoImageProcessor.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:
        raise VisionConfigError(
            f"{PREPROCESSOR_CONFIG} cannot be loaded: {type(exc).__name__}: {exc}"
        ) from exc
    resize = getattr(sys.modules.get(type(processor).__module__), "smart_resize", None)
    if resize is None or not hasattr(processor, "get_number_of_image_patches"):
        raise VisionConfigError(
            f"the image processor {type(processor).__name__} is not one of the Qwen-VL family's (Qwen2-VL, "
            "Qwen2.5-VL, Qwen3-VL): its token counts are unknown to this proxy"
        )
    model = VisionModel(
        image_token_id=_image_token_id(directory, tokenizer),
        patch_size=int(processor.patch_size),
        merge_size=int(processor.merge_size),
        processor_config=processor_config,
        _processor=processor,
        _resize=resize,
    )
    model.check()
    return model


def _image_token_id(directory: Path, tokenizer: Any) -> int:
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    token_id = config.get("image_token_id") if isinstance(config, dict) else None
    if isinstance(token_id, int) and not isinstance(token_id, bool):
        return token_id
    vocabulary = tokenizer.get_vocab()
    if IMAGE_PAD in vocabulary:
        return int(vocabulary[IMAGE_PAD])
    raise VisionConfigError(f"no image_token_id in config.json and no {IMAGE_PAD} token in the vocabulary")
