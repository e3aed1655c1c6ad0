"""The vision-language families' model-directory files, beside their tokenizer: what SGLang and
transformers read to turn an image into tokens.

- `preprocessor_config.json`: each family's image processor settings, as the Hugging Face model
  repositories ship them (read from https://huggingface.co/Qwen/Qwen2.5-VL-7B-Instruct/blob/main/
  preprocessor_config.json and https://huggingface.co/Qwen/Qwen3-VL-8B-Instruct/blob/main/
  preprocessor_config.json; the same values are transformers' `Qwen2VLImageProcessor` defaults for
  Qwen2.5-VL, and patch 16 / mean and std 0.5 for Qwen3-VL). The image processor resizes each image
  to multiples of patch_size * merge_size within [min_pixels, max_pixels] (`smart_resize`), its grid
  (t, h, w) counts patches, and the image takes t * h * w / merge_size**2 tokens.
- `config.json`: only the fields SGLang's Qwen-VL processor reads (`QwenVLImageProcessor.__init__`
  in sglang/srt/multimodal/processors/qwen_vl.py: `model_type`, `vision_start_token_id`,
  `vision_end_token_id`, `image_token_id`, `video_token_id`, `vision_config.spatial_merge_size`),
  the architecture that selects that processor, and the vision encoder's patch sizes. No weights.

The vision specials are Qwen's own added tokens, at their real ids (the builder checks every added
token's id against the vocabulary it builds).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
# Qwen2-VL, Qwen2.5-VL and Qwen3-VL share these ids (their tokenizer_config.json and config.json).
VISION_TOKEN_IDS: Mapping[str, int] = {
    VISION_START: 151652,
    VISION_END: 151653,
    IMAGE_PAD: 151655,
    VIDEO_PAD: 151656,
}
# What a chat template writes for one image before SGLang expands it: a single pad.
IMAGE_PLACEHOLDER = VISION_START + IMAGE_PAD + VISION_END

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


@dataclass(frozen=True)
class VisionSpec:
    """A vision-language family's model-directory files other than the tokenizer's."""

    model_type: str
    architecture: str
    # preprocessor_config.json, as the family's Hugging Face repository ships it.
    preprocessor_config: Mapping[str, Any]
    # config.json's vision_config (the fields SGLang and transformers' get_rope_index read).
    vision_config: Mapping[str, Any]

    @property
    def patch_size(self) -> int:
        return int(self.preprocessor_config["patch_size"])

    @property
    def merge_size(self) -> int:
        return int(self.preprocessor_config["merge_size"])

    def config_json(self) -> dict[str, Any]:
        """config.json: the fields SGLang reads to serve the family's images."""
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "image_token_id": VISION_TOKEN_IDS[IMAGE_PAD],
            "video_token_id": VISION_TOKEN_IDS[VIDEO_PAD],
            "vision_start_token_id": VISION_TOKEN_IDS[VISION_START],
            "vision_end_token_id": VISION_TOKEN_IDS[VISION_END],
            "vision_config": dict(self.vision_config),
        }


QWEN25_VL = VisionSpec(
    model_type="qwen2_5_vl",
    architecture="Qwen2_5_VLForConditionalGeneration",
    preprocessor_config={
        "min_pixels": 3136,
        "max_pixels": 12845056,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD,
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor",
    },
    vision_config={
        "model_type": "qwen2_5_vl",
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "tokens_per_second": 2,
        "window_size": 112,
    },
)

QWEN3_VL = VisionSpec(
    model_type="qwen3_vl",
    architecture="Qwen3VLForConditionalGeneration",
    preprocessor_config={
        "size": {"longest_edge": 16777216, "shortest_edge": 65536},
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "processor_class": "Qwen3VLProcessor",
        "image_processor_type": "Qwen2VLImageProcessorFast",
    },
    vision_config={
        "model_type": "qwen3_vl",
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
)

VISION_SPECS: Mapping[str, VisionSpec] = {"qwen25_vl": QWEN25_VL, "qwen3_vl": QWEN3_VL}
