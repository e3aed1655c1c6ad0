"""A turn's routing replay rows from its SGLang answers (pure functions).

A turn asks for the routing of the positions from its first row on (`routed_experts.first_row`: the
path it continues has rows for every position but its last). Each answer covers
`[asked, its prompt + its output - 1)`; a generation the engine aborted and the proxy continued asks
again from the first position it still lacks, so every token keeps the routing of the forward pass
that first computed it (a token made before a weight update keeps the old weights' routing). An
aborted answer without routing (aborted before it ran) leaves its positions to the next.
"""

from __future__ import annotations

from collections.abc import Sequence

import pybase64
from rolloutfleet_wire.routed_experts import RoutingError, RoutingShape, rows_from_sglang

from .continuation import Segment


def next_start(start: int, prompt_length: int, segments: Sequence[Segment]) -> int:
    """The position the next request of a turn asks routing from, after `segments`."""
    have, position = start, prompt_length
    for segment in segments:
        outputs = len(segment.generation.output_ids)
        if segment.generation.routed_experts is not None:
            have = max(have, position + outputs - 1)
        position += outputs
    return have


def turn_rows(start: int, prompt_length: int, segments: Sequence[Segment], shape: RoutingShape) -> bytes:
    """The rows of positions [start, prompt + output - 1) from a turn's segments; RoutingError when
    an answer's routing does not fit, or the answers leave positions without routing."""
    rows = bytearray()
    have, position = start, prompt_length
    for segment in segments:
        generation = segment.generation
        end = position + len(generation.output_ids) - 1
        if generation.routed_experts is not None and end > have:
            # pybase64 (SIMD), as SGLang encodes them: 27x the standard library's decoder here.
            rows += rows_from_sglang(generation.routed_experts, have, end, shape, pybase64.b64decode)
            have = end
        position += len(generation.output_ids)
    if have < position - 1:
        missing = "no meta_info.routed_experts" if have == start else f"no routing from position {have} on"
        raise RoutingError(
            f"the engine answered {missing} (routing replay needs SGLang run with "
            "--enable-return-routed-experts, and a gateway that passes return_routed_experts)"
        )
    return bytes(rows)
