"""The exported batch: finished trajectories packed into one safetensors file, and its JSON view.

Packed, not padded: trajectories are concatenated and `cu_seqlens` delimits them, so the proxy never
holds padding (one 32k-token trajectory among short ones would multiply a padded batch's bytes). The
trainer client pads on its side and builds `attention_mask` there.

Tensors (N tokens, B trajectories, T turns in the batch):
    input_ids      int32   [N]     every token id of every trajectory, back to back
    loss_mask      uint8   [N]     1 on generated tokens
    logprobs       float32 [N]     logprob of each generated token, 0 elsewhere
    versions       int32   [N]     model version each generated token was produced under, -1 elsewhere
    cu_seqlens     int64   [B+1]   trajectory i is tokens cu_seqlens[i]:cu_seqlens[i+1]
    rewards        float32 [B]     the session reward, NaN when none was set
    turn_bounds    int32   [T, 3]  per turn [input_start, output_start, end], relative to its trajectory
    turn_versions  int32   [T]     model version per turn (of its first generated token)
    turn_temperatures float32 [T]  sampling temperature per turn (NaN: recorded before temperatures were)
    turn_tempered  uint8   [T]     1: the turn's logprobs are log_softmax(logits / temperature), as SGLang
                                   returns them when sampling; 0: raw log_softmax(logits) (greedy, T = 1,
                                   or engines with SGLANG_RETURN_ORIGINAL_LOGPROB=1)
    turn_rewards   float32 [T]     per-turn reward, NaN when none was set
    turn_finishes  uint8   [T]     how the engine ended each turn: 1 stop, 2 length (cut at max tokens:
                                   frameworks mark such a sample truncated), 3 abort, 0 unknown
    cu_turns       int64   [B+1]   trajectory i has turns cu_turns[i]:cu_turns[i+1]
Images (vision-language sessions; I images over the batch's samples, D distinct ones, S their bytes):
    image_data     uint8   [S]     each distinct image's bytes as the client sent them (PNG, JPEG,
                                   WebP), back to back: an image the batch's samples repeat is in once
    cu_image_data  int64   [D+1]   distinct image d is image_data[cu_image_data[d]:cu_image_data[d+1]]
    image_digests  uint8   [D, 32] the sha256 of each distinct image's bytes (what sessions name it by)
    image_refs     int32   [I]     per image of each sample, in prompt order: its distinct image d
    image_spans    int32   [I, 2]  per image [offset, tokens]: its run of image tokens in its trajectory
    image_grid_thw int32   [I, 3]  per image its grid (t, h, w) in patches, as the engine's processor made it
    cu_images      int64   [B+1]   trajectory i has images cu_images[i]:cu_images[i+1]
Routing replay (mixture-of-experts models, when the fleet records it; R rows over the batch):
    routed_experts uint8|uint16|uint32 [R, layers, top_k]  the experts each token was routed to, in the
                                   smallest type that holds the expert count: a trajectory of n tokens
                                   has the rows of its first n - 1 (its last token was never forwarded,
                                   as in SGLang's answer), or none when some turn of it was recorded
                                   without routing
    cu_routed_experts int64 [B+1]  trajectory i has rows cu_routed_experts[i]:cu_routed_experts[i+1]
The metadata key `rolloutfleet.export` holds a JSON header (batch id, per-trajectory session ids and
metadata, and each trajectory's place in its session's tree: `sample` = {turn, parent, call, path};
for a vision-language model `vision` = {image_token_id, processor_config}: the model directory's
`preprocessor_config.json`, with which a trainer rebuilds `pixel_values` from the image bytes; with
routing replay `routed_experts` = {layers, top_k, experts, dtype}).
A trajectory is one sample of a session (`session_tree.SampleShape`): by default the path to its
latest turn (all of a linear session), or one per leaf, or one per turn. Every function here is
blocking CPU work: call it from a worker thread.
"""

from __future__ import annotations

import math
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
from safetensors.numpy import load as safetensors_load
from safetensors.numpy import save as safetensors_save

from .routed_experts import RoutingShape, path_rows, row_offsets
from .session_record import (
    DIGEST_BYTES,
    FINISH_NAMES,
    TURN_BOUND_FIELDS,
    SessionRecord,
    image_spans,
    token_versions,
    turn_finish,
)
from .session_tree import SampleShape, samples

FORMAT = "rolloutfleet.export"
FORMAT_VERSION = 5
# Version 1 had no turn_temperatures / turn_tempered, 2 no turn_finishes, 3 no images, 4 no routing;
# their batches (restored after an upgrade) still read.
READABLE_VERSIONS = (1, 2, 3, 4, 5)
MEDIA_TYPE = "application/vnd.rolloutfleet.safetensors"

TENSOR_DTYPES = {
    "input_ids": np.int32,
    "loss_mask": np.uint8,
    "logprobs": np.float32,
    "versions": np.int32,
    "cu_seqlens": np.int64,
    "rewards": np.float32,
    "turn_bounds": np.int32,
    "turn_versions": np.int32,
    "turn_rewards": np.float32,
    "cu_turns": np.int64,
    "turn_temperatures": np.float32,
    "turn_tempered": np.uint8,
    "turn_finishes": np.uint8,
    "image_data": np.uint8,
    "cu_image_data": np.int64,
    "image_digests": np.uint8,
    "image_refs": np.int32,
    "image_spans": np.int32,
    "image_grid_thw": np.int32,
    "cu_images": np.int64,
    "cu_routed_experts": np.int64,
}
# routed_experts' dtype is the header's: the smallest unsigned type that holds the expert count.
IMAGE_SPAN_FIELDS = 2  # offset, tokens
GRID_FIELDS = 3  # t, h, w


@dataclass(frozen=True)
class ExportImages:
    """What a vision-language model's batches carry besides tokens: each image's bytes (`read`, by
    sha256; blocking, like encoding) and what a trainer rebuilds the model's image inputs with."""

    read: Callable[[bytes], bytes]
    image_token_id: int
    processor_config: dict[str, Any]  # preprocessor_config.json's content


@dataclass(frozen=True)
class ExportRouting:
    """Routing replay's rows of a session (`read`, blocking: every turn's rows in recording order,
    as routed_experts.row_offsets lays them out) and their shape."""

    read: Callable[[SessionRecord], bytes]
    shape: RoutingShape


class BatchFormatError(ValueError):
    pass


@dataclass
class DecodedBatch:
    header: dict[str, Any]
    tensors: dict[str, np.ndarray]

    @property
    def batch_id(self) -> str:
        batch_id: str = self.header["batch_id"]
        return batch_id

    @property
    def num_trajectories(self) -> int:
        return len(self.tensors["rewards"])

    def trajectory(self, i: int, image_bytes: bool = False) -> dict[str, Any]:
        """One trajectory as plain Python lists (the JSON view). With `image_bytes`, each image also
        carries its bytes (`data`, as the client sent them: no longer JSON) and the trajectory the
        batch's `vision` (what a trainer rebuilds the model's image inputs with)."""
        t = self.tensors
        start, end = int(t["cu_seqlens"][i]), int(t["cu_seqlens"][i + 1])
        first_turn, last_turn = int(t["cu_turns"][i]), int(t["cu_turns"][i + 1])
        info = self.header["trajectories"][i]
        return {
            "session_id": info["session_id"],
            "metadata": info["metadata"],
            "created_at": info["created_at"],
            "sample": info.get("sample"),  # batches written before trees have none
            "input_ids": t["input_ids"][start:end].tolist(),
            "attention_mask": [1] * (end - start),
            "loss_mask": t["loss_mask"][start:end].tolist(),
            "logprobs": t["logprobs"][start:end].tolist(),
            "versions": t["versions"][start:end].tolist(),
            "reward": _finite_or_none(t["rewards"][i]),
            "turn_bounds": t["turn_bounds"][first_turn:last_turn].tolist(),
            "turn_versions": t["turn_versions"][first_turn:last_turn].tolist(),
            "turn_rewards": [_finite_or_none(r) for r in t["turn_rewards"][first_turn:last_turn]],
            "turn_temperatures": [_finite_or_none(x) for x in t["turn_temperatures"][first_turn:last_turn]],
            "turn_tempered": [bool(x) for x in t["turn_tempered"][first_turn:last_turn]],
            "turn_finishes": [
                FINISH_NAMES.get(int(x), "unknown") for x in t["turn_finishes"][first_turn:last_turn]
            ],
            "images": [self._image(k, image_bytes) for k in self.image_range(i)],
            **({"vision": self.vision} if image_bytes else {}),
            # Routing replay's rows stay in the tensors (`routed_experts(i)`): as lists, a 32k-token
            # trajectory's would be 12.6 million Python ints.
            "routed_experts_rows": len(self.routed_experts(i)),
        }

    def _image(self, k: int, with_bytes: bool) -> dict[str, Any]:
        t = self.tensors
        image = {
            "offset": int(t["image_spans"][k, 0]),
            "tokens": int(t["image_spans"][k, 1]),
            "grid_thw": t["image_grid_thw"][k].tolist(),
            "sha256": t["image_digests"][t["image_refs"][k]].tobytes().hex(),
        }
        if with_bytes:
            image["data"] = self.image_bytes(k)
        return image

    @property
    def routing(self) -> RoutingShape | None:
        """The shape of the batch's routing replay rows, if it has any."""
        value = self.header.get("routed_experts")
        return None if value is None else RoutingShape.from_json(value)

    def routed_experts(self, i: int) -> np.ndarray:
        """Trajectory i's routing rows [tokens - 1, layers, top_k] (none: [0, layers, top_k])."""
        cu = self.tensors["cu_routed_experts"]
        return self.tensors["routed_experts"][int(cu[i]) : int(cu[i + 1])]

    @property
    def vision(self) -> dict[str, Any] | None:
        """`image_token_id` and `processor_config` of a vision-language model's batch, else None."""
        vision: dict[str, Any] | None = self.header.get("vision")
        return vision

    def image_digest_set(self) -> frozenset[bytes]:
        """The sha256 of every distinct image of the batch."""
        return frozenset(row.tobytes() for row in self.tensors["image_digests"])

    def image_range(self, i: int) -> range:
        """The batch's images (indexes into image_refs, image_spans, image_grid_thw) of trajectory i."""
        cu = self.tensors["cu_images"]
        return range(int(cu[i]), int(cu[i + 1]))

    def image_bytes(self, k: int) -> bytes:
        """The bytes of the batch's image k (of image_refs), as the client sent them."""
        t = self.tensors
        d = int(t["image_refs"][k])
        return t["image_data"][int(t["cu_image_data"][d]) : int(t["cu_image_data"][d + 1])].tobytes()


def _finite_or_none(value: float) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


def _concat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)


def _token_versions(record: SessionRecord) -> np.ndarray:
    return np.frombuffer(token_versions(record), np.int32)


def _image_tensors(records: list[SessionRecord], images: ExportImages | None) -> dict[str, np.ndarray]:
    """The samples' images: each distinct one's bytes once, then per sample its images in order."""
    distinct: dict[bytes, int] = {}
    refs: list[int] = []
    spans: list[tuple[int, int]] = []
    grids: list[tuple[int, int, int]] = []
    counts: list[int] = []
    for record in records:
        found = image_spans(record)
        counts.append(len(found))
        for image in found:
            refs.append(distinct.setdefault(image.digest, len(distinct)))
            spans.append((image.offset, image.tokens))
            grids.append(image.grid)
    if distinct and images is None:
        raise ValueError("the sessions hold images, but no image store was given to read them from")
    data = bytearray()  # one image read at a time, appended: no list of copies
    ends = [0]
    for digest in distinct:
        assert images is not None
        data += images.read(digest)
        ends.append(len(data))
    return {
        "image_data": np.frombuffer(data, np.uint8),
        "cu_image_data": np.array(ends, np.int64),
        "image_digests": np.frombuffer(b"".join(distinct), np.uint8).reshape(-1, DIGEST_BYTES),
        "image_refs": np.array(refs, np.int32),
        "image_spans": np.array(spans, np.int32).reshape(-1, IMAGE_SPAN_FIELDS),
        "image_grid_thw": np.array(grids, np.int32).reshape(-1, GRID_FIELDS),
        "cu_images": np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64),
    }


def _no_images(trajectories: int) -> dict[str, np.ndarray]:
    """The image tensors of a batch written before images were exported."""
    return {
        "image_data": np.zeros(0, np.uint8),
        "cu_image_data": np.zeros(1, np.int64),
        "image_digests": np.zeros((0, DIGEST_BYTES), np.uint8),
        "image_refs": np.zeros(0, np.int32),
        "image_spans": np.zeros((0, IMAGE_SPAN_FIELDS), np.int32),
        "image_grid_thw": np.zeros((0, GRID_FIELDS), np.int32),
        "cu_images": np.zeros(trajectories + 1, np.int64),
    }


def _routing_tensors(
    sessions: list[SessionRecord], sample_turns: list[list[int]], routing: ExportRouting | None
) -> dict[str, np.ndarray]:
    """Each sample's routing rows (gathered from its session's rows like its tokens), or none."""
    if routing is None:
        return _no_routing(sum(len(turns) for turns in sample_turns))
    shape = routing.shape
    parts: list[np.ndarray] = []
    counts: list[int] = []
    for session, turns in zip(sessions, sample_turns, strict=True):
        offsets = row_offsets(session)
        rows = np.frombuffer(routing.read(session), shape.dtype).reshape(-1, shape.layers, shape.top_k)
        if len(rows) != offsets[-1]:
            raise ValueError(f"session {session.session_id} has {len(rows)} routing rows, not {offsets[-1]}")
        for turn in turns:
            taken = [rows[start:end] for start, end in path_rows(session, turn, offsets) or ()]
            parts.extend(taken)
            counts.append(sum(len(p) for p in taken))
    return {
        "routed_experts": np.concatenate(parts)
        if parts
        else np.zeros((0, shape.layers, shape.top_k), shape.dtype),
        "cu_routed_experts": np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64),
    }


def _no_routing(trajectories: int) -> dict[str, np.ndarray]:
    """The routing tensors of a batch without routing replay."""
    return {
        "routed_experts": np.zeros((0, 0, 0), np.uint8),
        "cu_routed_experts": np.zeros(trajectories + 1, np.int64),
    }


def encode_batch(
    batch_id: str,
    sessions: list[SessionRecord],
    model_version: int,
    shape: SampleShape | None = None,
    images: ExportImages | None = None,
    routing: ExportRouting | None = None,
) -> bytes:
    """The safetensors bytes of one batch of finished sessions, each as the samples `shape` asks;
    a vision-language model's (`images`) with their images and its processor configuration; with
    routing replay (`routing`) each sample's routing rows."""
    shape = shape or SampleShape()
    records: list[SessionRecord] = []
    places: list[dict[str, Any]] = []
    sample_turns: list[list[int]] = []
    for session in sessions:
        sample_turns.append([])
        for record, place in samples(session, shape):
            records.append(record)
            places.append(place)
            sample_turns[-1].append(place["turn"])
    lengths = [len(r.token_ids) for r in records]
    turn_counts = [len(r.turn_bounds) // TURN_BOUND_FIELDS for r in records]
    tensors = {
        "input_ids": _concat([np.frombuffer(r.token_ids, np.int32) for r in records], np.int32),
        "loss_mask": _concat([np.frombuffer(r.loss_mask, np.uint8) for r in records], np.uint8),
        "logprobs": _concat([np.frombuffer(r.logprobs, np.float32) for r in records], np.float32),
        "versions": _concat([_token_versions(r) for r in records], np.int32),
        "cu_seqlens": np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64),
        "rewards": np.array([math.nan if r.reward is None else r.reward for r in records], np.float32),
        "turn_bounds": _concat([np.frombuffer(r.turn_bounds, np.int32) for r in records], np.int32).reshape(
            -1, TURN_BOUND_FIELDS
        ),
        "turn_versions": _concat([np.frombuffer(r.turn_versions, np.int32) for r in records], np.int32),
        "turn_rewards": np.array(
            [
                r.turn_rewards.get(t, math.nan)
                for r, n in zip(records, turn_counts, strict=True)
                for t in range(n)
            ],
            np.float32,
        ),
        "cu_turns": np.concatenate([[0], np.cumsum(turn_counts, dtype=np.int64)]).astype(np.int64),
        "turn_temperatures": _concat(
            [np.frombuffer(r.turn_temperatures, np.float32) for r in records], np.float32
        ),
        "turn_tempered": _concat([np.frombuffer(r.turn_tempered, np.uint8) for r in records], np.uint8),
        "turn_finishes": np.array(
            [turn_finish(r, t) for r, n in zip(records, turn_counts, strict=True) for t in range(n)], np.uint8
        ),
        **_image_tensors(records, images),
        **_routing_tensors(sessions, sample_turns, routing),
    }
    header = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "batch_id": batch_id,
        "created_at": time.time(),
        "model_version": model_version,
        "sample_shape": {
            "mode": (shape or SampleShape()).mode,
            "drop_replaced": (shape or SampleShape()).drop_replaced,
        },
        "trajectories": [
            {"session_id": r.session_id, "metadata": r.metadata, "created_at": r.created_at, "sample": place}
            for r, place in zip(records, places, strict=True)
        ],
        "vision": None
        if images is None
        else {"image_token_id": images.image_token_id, "processor_config": images.processor_config},
        "routed_experts": None if routing is None else routing.shape.to_json(),
    }
    return safetensors_save(tensors, metadata={FORMAT: orjson.dumps(header).decode()})


def _metadata(data: bytes) -> dict[str, str]:
    # safetensors.numpy.load returns tensors only; the header is 8 bytes of length, then JSON.
    (length,) = struct.unpack("<Q", data[:8])
    return orjson.loads(data[8 : 8 + length]).get("__metadata__") or {}


def decode_batch(data: bytes) -> DecodedBatch:
    """Read and check a batch; anything malformed raises BatchFormatError."""
    try:
        header = orjson.loads(_metadata(data)[FORMAT])
        tensors = safetensors_load(data)
    except Exception as exc:
        raise BatchFormatError(f"not a readable {FORMAT} file: {type(exc).__name__}: {exc}") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise BatchFormatError(f"no {FORMAT} header")
    if header.get("format_version") not in READABLE_VERSIONS:
        raise BatchFormatError(f"unsupported {FORMAT} version {header.get('format_version')!r}")
    if header["format_version"] == 1:
        turns = len(tensors.get("turn_versions", ()))
        tensors.setdefault("turn_temperatures", np.full(turns, np.nan, np.float32))
        tensors.setdefault("turn_tempered", np.zeros(turns, np.uint8))
    if header["format_version"] < 3:
        tensors.setdefault("turn_finishes", np.zeros(len(tensors.get("turn_versions", ())), np.uint8))
    if header["format_version"] < 4:
        for name, empty in _no_images(len(tensors.get("rewards", ()))).items():
            tensors.setdefault(name, empty)
    if header["format_version"] < 5:
        for name, empty in _no_routing(len(tensors.get("rewards", ()))).items():
            tensors.setdefault(name, empty)
    for name, dtype in TENSOR_DTYPES.items():
        if name not in tensors or tensors[name].dtype != dtype:
            raise BatchFormatError(f"tensor {name} is missing or not {np.dtype(dtype).name}")
    t = tensors
    n, b = len(t["input_ids"]), len(t["rewards"])
    infos = header.get("trajectories")
    consistent = (
        isinstance(infos, list)
        and len(infos) == b
        and all(isinstance(i, dict) and "session_id" in i for i in infos)
        and len(t["loss_mask"]) == len(t["logprobs"]) == len(t["versions"]) == n
        and len(t["cu_seqlens"]) == len(t["cu_turns"]) == b + 1
        and int(t["cu_seqlens"][-1]) == n
        and t["turn_bounds"].shape == (len(t["turn_versions"]), TURN_BOUND_FIELDS)
        and len(t["turn_rewards"]) == len(t["turn_versions"]) == int(t["cu_turns"][-1])
        and len(t["turn_temperatures"]) == len(t["turn_tempered"]) == len(t["turn_versions"])
        and len(t["turn_finishes"]) == len(t["turn_versions"])
        and isinstance(header.get("batch_id"), str)
        and _images_consistent(t, b)
        and _routing_consistent(header, t, b)
    )
    if not consistent:
        raise BatchFormatError("tensors and header of the batch do not agree")
    return DecodedBatch(header, tensors)


def _routing_consistent(header: dict[str, Any], t: dict[str, np.ndarray], trajectories: int) -> bool:
    """Rows of the header's shape and dtype; each trajectory has none or one per token but its last."""
    rows, cu = t.get("routed_experts"), t["cu_routed_experts"]
    if rows is None or len(cu) != trajectories + 1 or int(cu[0]) != 0 or int(cu[-1]) != len(rows):
        return False
    counts, lengths = np.diff(cu), np.diff(t["cu_seqlens"])
    if not bool(np.all((counts == 0) | (counts == np.maximum(lengths - 1, 0)))):
        return False
    if header.get("routed_experts") is None:
        return len(rows) == 0
    try:
        shape = RoutingShape.from_json(header["routed_experts"])
    except (KeyError, TypeError, ValueError):
        return False
    return rows.dtype == shape.dtype and rows.shape[1:] == (shape.layers, shape.top_k)


def _images_consistent(t: dict[str, np.ndarray], trajectories: int) -> bool:
    distinct, count = len(t["image_digests"]), len(t["image_refs"])
    return (
        len(t["cu_images"]) == trajectories + 1
        and int(t["cu_images"][-1]) == count
        and bool(np.all(np.diff(t["cu_images"]) >= 0))
        and t["image_spans"].shape == (count, IMAGE_SPAN_FIELDS)
        and t["image_grid_thw"].shape == (count, GRID_FIELDS)
        and t["image_digests"].shape == (distinct, DIGEST_BYTES)
        and len(t["cu_image_data"]) == distinct + 1
        and int(t["cu_image_data"][0]) == 0
        and int(t["cu_image_data"][-1]) == len(t["image_data"])
        and bool(np.all(np.diff(t["cu_image_data"]) >= 0))
        and bool(np.all((t["image_refs"] >= 0) & (t["image_refs"] < distinct)))
    )


def batch_json(data: bytes) -> bytes:
    """The JSON view of a batch: the same data, one object per trajectory (for debugging)."""
    batch = decode_batch(data)
    return orjson.dumps(
        {
            "batch_id": batch.batch_id,
            "created_at": batch.header["created_at"],
            "model_version": batch.header["model_version"],
            "num_trajectories": batch.num_trajectories,
            "num_tokens": len(batch.tensors["input_ids"]),
            "vision": batch.vision,
            "trajectories": [batch.trajectory(i) for i in range(batch.num_trajectories)],
        }
    )
