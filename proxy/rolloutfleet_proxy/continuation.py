"""One turn from several SGLang answers: an aborted generation is continued, not thrown away.

SGLang answers an aborted request (`/pause_generation` in abort mode, a weight update with
`abort_all_requests`, `/abort_request`) with HTTP 200, `finish_reason.type == "abort"` and the
tokens it made so far. The proxy keeps them and resubmits the prompt plus those tokens with the
rest of the token budget, as AReaL does, so no generated token is wasted and the client still gets
one reply. Each segment keeps the weight version it was generated under. A generation under a grammar
(a forced tool call) is the exception: it starts over from its prompt.

Pure functions: the loop that calls the upstream lives in `turns.py`.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from .generation import MAX_MODEL_VERSION
from .upstream import Generation

# Waits between resubmissions of a generation the engine aborted without making a token (its
# weights are being updated, or it is paused by the trainer): exponential from the first, capped,
# so a turn notices the engine generating again within about the cap of its resume.
ABORT_BACKOFF_FIRST_S = 0.05
ABORT_BACKOFF_CAP_S = 1.0


def abort_backoff_s(idle_aborts: int, jitter: float) -> float:
    """The wait before resubmitting after `idle_aborts` aborts in a row that made no token (0: the
    last abort kept tokens, so the engine generates: resubmit at once); `jitter` in [0, 1) spreads
    the turns of many sessions. Pure."""
    if idle_aborts <= 0:
        return 0.0
    return min(ABORT_BACKOFF_CAP_S, ABORT_BACKOFF_FIRST_S * 2 ** (idle_aborts - 1)) * (0.5 + jitter / 2)


# SGLang's defaults for sampling parameters a request leaves out (SamplingParams.__init__).
SGLANG_DEFAULT_TEMPERATURE = 1.0
# SGLang samples greedily below this temperature (sampling_params._SAMPLING_EPS) and then returns
# the raw log_softmax; so it does for top_k == 1.
SGLANG_SAMPLING_EPS = 1e-6


@dataclass(frozen=True)
class Segment:
    generation: Generation
    version: int  # the model version its tokens were generated under


@dataclass(frozen=True)
class MergedTurn:
    generation: Generation  # all segments' tokens as one answer, finished as the last one finished
    version: int  # the version of the first segment
    version_changes: list[tuple[int, int]]  # (offset into output_ids, version) where it changed
    continuations: int  # segments after the first
    routing: bytes | None = None  # routing replay's rows for the turn (routing_rows.turn_rows), when asked


def engine_version(weight_version: str | None, fallback: int) -> int:
    """The model version of an SGLang answer: its `weight_version` when that is an integer (the
    trainer client sets it to the version it publishes), else the proxy's own version."""
    if weight_version is None:
        return fallback
    try:
        version = int(weight_version.strip())
    except ValueError:
        return fallback
    return version if 0 <= version <= MAX_MODEL_VERSION else fallback


def logprobs_tempered(engine_logprobs: str, sampling_params: dict[str, Any]) -> tuple[float, bool]:
    """(sampling temperature, whether SGLang's logprobs for it are log_softmax(logits / temperature)).

    SGLang's Sampler returns tempered logprobs on its sampling path unless the engine runs with
    SGLANG_RETURN_ORIGINAL_LOGPROB=1 (`engine_logprobs == "original"`); greedy decoding
    (temperature below its epsilon, or top_k == 1) returns the raw log_softmax; at temperature 1
    the two are the same."""
    temperature = float(sampling_params.get("temperature", SGLANG_DEFAULT_TEMPERATURE))
    greedy = temperature < SGLANG_SAMPLING_EPS or sampling_params.get("top_k") == 1
    tempered = engine_logprobs == "tempered" and not greedy and not math.isclose(temperature, 1.0)
    return temperature, tempered


# Sampling parameters that constrain generation from its first output token (SamplingParams).
GRAMMAR_PARAMETERS = ("ebnf", "json_schema", "regex", "structural_tag")


def restarts_after_abort(sampling_params: dict[str, Any]) -> bool:
    """A constrained generation cannot be continued from its tokens: resubmitted with them as prompt, the
    engine would start its grammar over after them. Such a sample is generated anew from its prompt."""
    return any(sampling_params.get(name) is not None for name in GRAMMAR_PARAMETERS)


def continuation_request(
    prompt: array, sampling_params: dict[str, Any], segments: Sequence[Segment]
) -> tuple[array, dict[str, Any]] | None:
    """The prompt and sampling parameters that continue a turn after aborted `segments`, or None
    when the budget is spent (the turn then ends as `length`)."""
    produced = [t for s in segments for t in s.generation.output_ids]
    remaining = int(sampling_params["max_new_tokens"]) - len(produced)
    if remaining <= 0:
        return None
    sampling = {**sampling_params, "max_new_tokens": remaining}
    min_new = sampling_params.get("min_new_tokens")
    if isinstance(min_new, int) and not isinstance(min_new, bool):
        sampling["min_new_tokens"] = max(0, min_new - len(produced))
    return prompt + array("i", produced), sampling


def merge_segments(
    segments: Sequence[Segment], max_new_tokens: int, decode: Callable[[list[int]], str]
) -> MergedTurn:
    """One answer from a turn's segments. A single segment is returned as it came; several are
    decoded again as one text (decoding pieces apart can split a character at the seam)."""
    first, last = segments[0], segments[-1]
    if len(segments) == 1:
        return MergedTurn(first.generation, first.version, [], 0)
    output_ids = array("i")
    logprobs = array("f")
    changes: list[tuple[int, int]] = []
    current: int | None = None  # the version of the tokens so far; a segment without tokens has none
    for segment in segments:
        ids = segment.generation.output_ids
        if not ids:
            continue
        if current is None:
            current = segment.version
        elif segment.version != current:
            changes.append((len(output_ids), segment.version))
            current = segment.version
        output_ids.extend(ids)
        logprobs.extend(segment.generation.logprobs)
    first_version = next((s.version for s in segments if s.generation.output_ids), last.version)
    ended = last.generation
    finish = ended.finish_reason
    if ended.aborted and len(output_ids) >= max_new_tokens:
        finish = "length"  # aborted exactly as the budget ran out
    text = decode(output_ids.tolist())
    if ended.stop_string:
        at = text.find(ended.stop_string)
        if at >= 0:
            text = text[:at]
    merged = replace(
        ended,
        output_ids=output_ids,
        logprobs=logprobs,
        text=text,
        finish_reason=finish,
        prompt_tokens=first.generation.prompt_tokens,
        cached_tokens=first.generation.cached_tokens,
        abort_message=None if finish != "abort" else ended.abort_message,
    )
    return MergedTurn(merged, first_version, changes, len(segments) - 1)
