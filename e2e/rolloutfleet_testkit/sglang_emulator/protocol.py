"""What SGLang accepts and how it finishes, as pure functions (the emulator's request rules).

Each rule follows a named piece of SGLang's source (read, not copied):
- `SamplingParams.__init__` defaults and `SamplingParams.verify` ranges and messages;
- `TokenizerManager._validate_one_request`: the context-length checks and their messages;
- `Req.check_finished`: max_new_tokens is tested before stop tokens, then stop strings;
- `_create_error_response`: refusals are HTTP 400 `{"error": {"message": ...}}`;
- `GenerateReqInput._handle_parallel_sampling`: `sampling_params["n"]` is the number of parallel
  samples of the prompt;
- `SamplingParams.verify`: at most one of `json_schema`, `regex` and `ebnf`; `Scheduler.
  handle_generate_request` takes the first of json_schema, regex, ebnf, structural_tag that is set
  (enforced by `grammar.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

# SamplingParams: temperatures below this decode greedily (temperature 1, top_k 1).
SAMPLING_EPS = 1e-6
DEFAULT_MAX_NEW_TOKENS = 128

# The fields SamplingParams.__init__ takes; any other is a TypeError that SGLang answers with 400.
SAMPLING_FIELDS = frozenset(
    {
        "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
        "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens",
        "n", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
        "spaces_between_special_tokens", "no_stop_trim", "custom_params", "stream_interval",
        "logit_bias", "sampling_seed",
    }
)  # fmt: skip


class BadRequest(ValueError):
    """A request SGLang refuses with HTTP 400."""


class ServerError(TypeError):
    """A request SGLang fails on with an unhandled exception: HTTP 500 `Internal Server Error`."""


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int
    min_new_tokens: int
    temperature: float  # 0 means greedy
    top_p: float
    top_k: int  # -1: all
    stop_token_ids: frozenset[int]
    stop_strings: tuple[str, ...]
    ignore_eos: bool
    no_stop_trim: bool
    seed: int | None
    constraint: tuple[str, str] | None = None  # (json_schema | regex | ebnf | structural_tag, its text)


def _number(params: dict, key: str, default: float) -> float:
    value = params.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"{key} must be a number, got {value!r}.")
    return float(value)


def _integer(params: dict, key: str, default: int | None) -> int | None:
    value = params.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{key} must be an integer, got {value!r}.")
    return value


# A request's grammar fields, in the order SGLang's scheduler takes the first one set.
CONSTRAINT_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")


def constraint_of(params: dict) -> tuple[str, str] | None:
    """(field, value) of the request's grammar, or None; two of json_schema, regex and ebnf are refused
    with SamplingParams.verify's message."""
    exclusive = [name for name in ("json_schema", "regex", "ebnf") if params.get(name) is not None]
    if len(exclusive) > 1:
        raise BadRequest("Only one of regex, json_schema, or ebnf can be set.")
    for name in CONSTRAINT_FIELDS:
        value = params.get(name)
        if value is not None:
            if not isinstance(value, str):
                raise BadRequest(f"{name} must be a string")
            return name, value
    return None


def parse_sampling(params: object, eos_token_id: int | None, vocab_size: int) -> Sampling:
    """SamplingParams(**params) and .verify(): SGLang's defaults, ranges and messages."""
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise BadRequest("sampling_params must be an object")
    unknown = sorted(set(params) - SAMPLING_FIELDS)
    if unknown:  # SamplingParams.__init__ raises TypeError for an unknown keyword
        raise BadRequest(f"SamplingParams.__init__() got an unexpected keyword argument '{unknown[0]}'")
    temperature = _number(params, "temperature", 1.0)
    top_p = _number(params, "top_p", 1.0)
    top_k = _integer(params, "top_k", -1)
    min_p = _number(params, "min_p", 0.0)
    max_new_tokens = _integer(params, "max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    min_new_tokens = _integer(params, "min_new_tokens", 0)
    assert top_k is not None and max_new_tokens is not None and min_new_tokens is not None
    # SamplingParams.verify, in its order.
    if temperature < 0.0:
        raise BadRequest(f"temperature must be non-negative, got {temperature}.")
    if not 0.0 < top_p <= 1.0:
        raise BadRequest(f"top_p must be in (0, 1], got {top_p}.")
    if not 0.0 <= min_p <= 1.0:
        raise BadRequest(f"min_p must be in [0, 1], got {min_p}.")
    if top_k < -1 or top_k == 0:
        raise BadRequest(f"top_k must be -1 (disable), or at least 1, got {top_k}.")
    for key in ("frequency_penalty", "presence_penalty"):
        value = _number(params, key, 0.0)
        if not -2.0 <= value <= 2.0:
            raise BadRequest(f"{key} must be in [-2, 2], got {value}.")
    repetition = _number(params, "repetition_penalty", 1.0)
    if not 0.0 < repetition <= 2.0:
        raise BadRequest(f"repetition_penalty must be in (0, 2], got {repetition}.")
    if not min_new_tokens >= 0:
        raise BadRequest(f"min_new_tokens must be in [0, max_new_tokens], got {min_new_tokens}.")
    if max_new_tokens < 0:
        raise BadRequest(f"max_new_tokens must be at least 0, got {max_new_tokens}.")
    if min_new_tokens > max_new_tokens:
        raise BadRequest(
            f"min_new_tokens must be in [0, max_new_tokens({max_new_tokens})], got {min_new_tokens}."
        )
    stops = params.get("stop_token_ids") or []
    if not isinstance(stops, list) or not all(isinstance(t, int) and 0 <= t < vocab_size for t in stops):
        raise BadRequest("stop_token_ids must be a list of token ids")
    ignore_eos = bool(params.get("ignore_eos", False))
    stop_ids = set(stops)
    if eos_token_id is not None and not ignore_eos:  # stop_token_ids add to EOS, not replace it
        stop_ids.add(eos_token_id)
    stop = params.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("stop must be a string or a list of strings")
    greedy = temperature < SAMPLING_EPS or top_k == 1
    constraint = constraint_of(params)
    return Sampling(
        max_new_tokens=max_new_tokens,
        min_new_tokens=min_new_tokens,
        temperature=0.0 if greedy else temperature,
        top_p=top_p,
        top_k=top_k,
        stop_token_ids=frozenset(stop_ids),
        stop_strings=tuple(stop),
        ignore_eos=ignore_eos,
        no_stop_trim=bool(params.get("no_stop_trim", False)),
        seed=_integer(params, "sampling_seed", None),
        constraint=constraint,
    )


def parallel_sample_num(params: object) -> int:
    """GenerateReqInput._handle_parallel_sampling: `sampling_params.get("n", 1)`; above 1 the single
    prompt becomes a batch of that many samples, at most 1 (0 and negatives too) it stays a single
    request. SGLang compares n with 1 and ranges over it unchecked: anything but an integer (null, a
    string, a float) raises a TypeError there, which its server answers with HTTP 500."""
    if not isinstance(params, dict):
        return 1
    n = params.get("n", 1)
    if not isinstance(n, int):
        raise ServerError(f"parallel sample number n must be an integer, got {n!r}")
    return int(n)  # a bool is an int to Python (True > 1 is False): a single request


def check_context_length(input_length: int, max_new_tokens: int, context_length: int) -> None:
    """TokenizerManager._validate_one_request (without --allow-auto-truncate)."""
    if input_length >= context_length:
        raise BadRequest(
            f"The input ({input_length} tokens) is longer than the model's context length "
            f"({context_length} tokens)."
        )
    total = max_new_tokens + input_length
    if total >= context_length:
        raise BadRequest(
            f"Requested token count exceeds the model's maximum context length of {context_length} "
            f"tokens. You requested a total of {total} tokens: {input_length} tokens from the input "
            f"messages and {max_new_tokens} tokens for the completion. Please reduce the number of "
            "tokens in the input messages or the completion to fit within the limit."
        )


def finish_reason(
    output_ids: list[int], text: str, sampling: Sampling, grammar_terminated: bool = False
) -> dict | None:
    """Req.check_finished after each new token: length first, then a grammar that has terminated (it
    accepted a stop token where it may end), then a stop token, then a stop string in the decoded
    output; None while generation goes on."""
    if len(output_ids) >= sampling.max_new_tokens:
        return {"type": "length", "length": sampling.max_new_tokens}
    if grammar_terminated:
        return {"type": "stop", "matched": output_ids[-1]}
    if output_ids and output_ids[-1] in sampling.stop_token_ids:
        return {"type": "stop", "matched": output_ids[-1]}
    for stop in sampling.stop_strings:
        if stop in text:
            return {"type": "stop", "matched": stop}
    return None


def trimmed_text(text: str, finish: dict | None, sampling: Sampling) -> str:
    """The answer's text: cut before a matched stop string unless no_stop_trim (its tokens stay in
    output_ids and the logprobs either way)."""
    if finish and isinstance(finish.get("matched"), str) and not sampling.no_stop_trim:
        at = text.find(finish["matched"])
        if at >= 0:
            return text[:at]
    return text
