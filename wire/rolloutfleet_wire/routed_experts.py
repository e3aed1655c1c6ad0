"""Routing replay (R3): which experts each token of a mixture-of-experts model was routed to.

What SGLang reports (read from its source):
- The engine captures routing when started with `--enable-return-routed-experts`
  (`ServerArgs.enable_return_routed_experts`); a `/generate` asks for it with `return_routed_experts`
  and may start it at `routed_experts_start_len` (`GenerateReqInput`: "response covers
  `[routed_experts_start_len, seqlen - 1)`, must be in [0, prompt_tokens]").
- `topk.select_experts` hands each layer's top-k expert ids to `RoutedExpertsCapturer.capture`; they
  are kept per KV slot in a host buffer of shape (slots, num_hidden_layers, num_experts_per_tok), int32
  (`_RoutedExpertsHostCache`). A finished request collects `buffer[req_to_token[:seqlen - 1]]`
  (`get_routed_experts`, called by `Scheduler.maybe_collect_routed_experts` once `req.finished()`,
  aborted requests included): one row per position that went through the model, prompt positions
  too (a cached prefix reports the rows its KV slots were computed with), never the last output
  token (it was sampled, not yet forwarded). `seqlen` is prompt plus output tokens.
- `DetokenizerManager._extract_routed_experts` sends it as base64 of the int32 array's bytes
  (little-endian, C order: token, layer, slot), which `TokenizerManager._handle_batch_output` puts in
  `meta_info["routed_experts"]`; `extract_routed_experts_from_meta_info` reads it back with
  `np.frombuffer(..., np.int32)`. Shapes are not sent: the reader knows num_hidden_layers and
  num_experts_per_tok from the model's config.json (SGLang's `hf_text_config`).
- slime and miles reshape it to (len(tokens) - 1, num_layers, top_k) over the whole sequence, prompt
  included: the trainer's forward pass routes every position, so replay needs every position's row.

What RolloutFleet keeps: one row per token of a session, from the forward pass that first computed
it, as the smallest unsigned integer type that holds the model's expert count; never rewritten by a
later turn (a turn continued across a weight update keeps each token's routing from the weights that
computed it). A turn stores the rows its path lacks: those of its own tokens but the last, and the
last token of the path it continues (that token was first forwarded by this turn's prefill). The
rows of a sample (a path) are gathered from its turns like its tokens: rows for positions
[0, tokens - 1); the last token has none, as in SGLang's answer.

Pure functions; numpy only.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .session_record import ROOT, SessionRecord
from .session_tree import path_length

# Where a model directory's config.json names the expert count (Qwen-MoE, DeepSeek/Kimi/GLM, Mixtral/gpt-oss).
EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")


class RoutingError(ValueError):
    """Routing that does not fit the model or the tokens it is for."""


@dataclass(frozen=True)
class RoutingShape:
    """The routing of one token: `layers` x `top_k` expert ids, each below `experts`."""

    layers: int
    top_k: int
    experts: int

    def __post_init__(self) -> None:
        if min(self.layers, self.top_k, self.experts) < 1 or self.top_k > self.experts:
            raise RoutingError(f"impossible routing shape {self}")

    @property
    def dtype(self) -> np.dtype:
        """The smallest unsigned integer type that holds every expert id."""
        for candidate in (np.uint8, np.uint16, np.uint32):
            if self.experts - 1 <= np.iinfo(candidate).max:
                return np.dtype(candidate)
        raise RoutingError(f"{self.experts} experts do not fit 32 bits")

    @property
    def row_values(self) -> int:
        return self.layers * self.top_k

    @property
    def row_bytes(self) -> int:
        return self.row_values * self.dtype.itemsize

    def to_json(self) -> dict[str, Any]:
        return {"layers": self.layers, "top_k": self.top_k, "experts": self.experts, "dtype": self.dtype.name}

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> RoutingShape:
        shape = cls(int(value["layers"]), int(value["top_k"]), int(value["experts"]))
        if "dtype" in value and value["dtype"] != shape.dtype.name:
            raise RoutingError(f"routing of {shape.experts} experts stored as {value['dtype']}")
        return shape


def shape_from_model_config(config: dict[str, Any]) -> RoutingShape:
    """The routing shape of a model's config.json, read as SGLang reads it (`hf_text_config`: a
    vision-language model's `text_config`): `num_hidden_layers`, `num_experts_per_tok`, and the expert
    count under one of EXPERT_COUNT_KEYS. RoutingError naming what is missing for a dense model."""
    nested = config.get("text_config")
    text: dict[str, Any] = nested if isinstance(nested, dict) else config
    experts = next((text[key] for key in EXPERT_COUNT_KEYS if isinstance(text.get(key), int)), None)
    layers, top_k = text.get("num_hidden_layers"), text.get("num_experts_per_tok")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (layers, top_k, experts)):
        raise RoutingError(
            "config.json names no mixture of experts: routing replay needs num_hidden_layers, "
            f"num_experts_per_tok and one of {', '.join(EXPERT_COUNT_KEYS)}"
        )
    return RoutingShape(int(layers), int(top_k), int(experts))  # type: ignore[arg-type]


def rows_from_sglang(
    payload: object,
    start: int,
    end: int,
    shape: RoutingShape,
    b64decode: Callable[..., bytes] = base64.b64decode,
) -> bytes:
    """The rows for positions [start, end) from SGLang's `meta_info.routed_experts` (base64 int32),
    as `shape.dtype` bytes. An engine that ignores `routed_experts_start_len` (releases before it)
    answers from position 0: its first `start` rows are dropped. RoutingError for anything else.
    `b64decode`: the standard library's, or a faster one with its signature (the proxy's)."""
    if not isinstance(payload, str):
        raise RoutingError("the answer has no meta_info.routed_experts")
    try:
        raw = b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise RoutingError("meta_info.routed_experts is not base64") from None
    values = np.frombuffer(raw, dtype="<i4") if len(raw) % 4 == 0 else None
    width = shape.row_values
    if values is None or len(values) % width:
        raise RoutingError(f"meta_info.routed_experts is not a whole number of rows of {width} int32")
    rows = len(values) // width
    if rows != end - start:
        if not (start > 0 and rows == end):
            raise RoutingError(
                f"meta_info.routed_experts holds {rows} rows, not the {end - start} of [{start}, {end})"
            )
        values = values[start * width :]
    if len(values) and (int(values.min()) < 0 or int(values.max()) >= shape.experts):
        raise RoutingError(f"meta_info.routed_experts names experts outside [0, {shape.experts})")
    return values.astype(shape.dtype).tobytes()


# --- where a session's rows are (its turns in recording order, like its tokens) -------------------


def first_row(record: SessionRecord, parent: int, keep: int) -> int:
    """The first path position whose row a turn continuing `parent` after `keep` tokens stores: the
    path it keeps has rows for every position but its last (when it keeps all of it)."""
    available = 0 if parent == ROOT else max(path_length(record, parent) - 1, 0)
    return min(keep, available)


def turn_rows(record: SessionRecord, turn: int) -> int:
    """Rows turn `turn` stores (whether or not it has them: see `turn_routed`)."""
    start = first_row(record, record.turn_parents[turn], record.turn_keeps[turn])
    return max(0, path_length(record, turn) - 1 - start)


def row_offsets(record: SessionRecord) -> list[int]:
    """Each turn's first row in the session's flat rows, and their end: turns without routing store none."""
    offsets = [0]
    for turn, routed in enumerate(record.turn_routed):
        offsets.append(offsets[-1] + (turn_rows(record, turn) if routed else 0))
    return offsets


def path_rows(
    record: SessionRecord, turn: int, offsets: list[int] | None = None
) -> list[tuple[int, int]] | None:
    """The flat row ranges whose concatenation is the rows of the path to `turn` (positions
    [0, path length - 1)), root first; None when a turn it needs rows from has none."""
    offsets = row_offsets(record) if offsets is None else offsets
    pieces: list[tuple[int, int]] = []
    limit = path_length(record, turn) - 1
    node = turn
    while limit > 0:
        if node == ROOT:
            return None
        start = first_row(record, record.turn_parents[node], record.turn_keeps[node])
        end = min(limit, path_length(record, node) - 1)
        if end > start:
            if not record.turn_routed[node]:
                return None
            pieces.append((offsets[node], offsets[node] + end - start))
        limit = min(limit, start)
        node = record.turn_parents[node]
    pieces.reverse()
    return pieces
