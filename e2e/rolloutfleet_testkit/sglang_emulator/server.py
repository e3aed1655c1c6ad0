"""HTTP server of the SGLang emulator: a TEST STAND-IN for a GPU SGLang server (no GPU exists here).

It emulates, behaviour by behaviour from SGLang's source, what the proxy, the router and a trainer
meet (`protocol.py`, `scheduler.py`, `radix_cache.py` name the SGLang functions each follows):
- `POST /generate`: token ids (or text) in; `text`, `output_ids` and `meta_info` (`id` = the
  request's `rid`, `finish_reason`, `prompt_tokens`, `completion_tokens`, `cached_tokens`,
  `weight_version`, `e2e_latency`, `output_token_logprobs` as `[logprob, id, text|null]`) out;
  streamed as cumulative chunks with `stream`. 400 `{"error": {"message"}}` for a prompt over the
  context length (`--context-length`) and for sampling parameters SGLang's `verify` refuses.
  `sampling_params.n` > 1 (parallel sampling, `TokenizerManager._handle_batch_request`): n samples of
  the prompt, each a request of its own with a fresh rid (the request's `rid` names none of them),
  answered as a JSON list in sample order; streamed, every chunk also carries its sample's `index`.
  Logprobs are tempered when sampling unless `SGLANG_RETURN_ORIGINAL_LOGPROB=1`.
  Images (multimodal.py): with a vision-language model directory (config.json and
  preprocessor_config.json beside the tokenizer), `image_data` (one item or a list of data URIs or
  bare base64) expands each image's single `<|image_pad|>` to its token count; `prompt_tokens` counts
  the expanded prompt, `meta_info.image_tokens` the image tokens, and `return_prompt_token_ids`
  answers the expanded ids as `prompt_token_ids` at the top level (for text prompts too).
  `sampling_seed` counts only with `--enable-deterministic-inference`, as in SGLang.
  `sampling_params.json_schema`, `regex`, `ebnf` or `structural_tag` constrain the output with xgrammar,
  SGLang's default grammar backend (grammar.py); two of the first three are a 400, as an invalid grammar.
  Routing replay (a mixture-of-experts model directory, whose config.json names experts; model.py),
  as SGLang's source has it: `--enable-return-routed-experts` (`ServerArgs.enable_return_routed_experts`)
  makes `RoutedExpertsCapturer.create` a real capturer (else a no-op one: the field is never
  answered); `topk.select_experts` hands it each layer's top-k ids (after the logical-to-physical
  mapping when EPLB runs), kept per KV slot in a host buffer [slots, num_hidden_layers,
  num_experts_per_tok] of int32 (`_RoutedExpertsHostCache`). A request with `return_routed_experts`
  (`GenerateReqInput`) gets, once it has ended, aborted ones included
  (`Scheduler.maybe_collect_routed_experts` -> `get_routed_experts(req_pool_idx, seqlen)`:
  `buffer[req_to_token[:seqlen - 1]]`), the rows of positions [`routed_experts_start_len`,
  prompt + output - 1): prompt positions too (a cached prefix reports what its slots were computed
  with), never the last output token (sampled, not forwarded). `DetokenizerManager._extract_routed_experts`
  sends them as base64 of the int32 bytes, `TokenizerManager._handle_batch_output` puts that in
  `meta_info["routed_experts"]`; no shape is sent (`extract_routed_experts_from_meta_info` reads
  int32; slime and miles reshape to (len(tokens) - 1, num_layers, moe_router_topk) and keep the last
  turn's). `routed_experts_start_len` outside [0, prompt_tokens] is a 400 here (SGLang's bound; its
  message differs). A streamed request gets the rows in its last chunk (they exist once it ended).
- `POST /pause_generation {"mode": "abort"|"retract"|"in_place"}`, `POST /continue_generation`,
  `POST /update_weights_from_disk {"model_path", "weight_version", "abort_all_requests",
  "flush_cache", "load_format"}` -> `{"success", "message", "num_paused_requests"}`,
  `POST /update_weight_version {"new_version", "abort_all_requests"}`, `GET /get_weight_version`,
  `POST /abort_request {"rid", "abort_all"}`, `POST /flush_cache`.
  Weights: `model_path` is a directory (or file) holding `emulator_weights.json` `{"seed": N}`;
  the model's weights are drawn from that seed (`write_weights` makes one).
- `GET /health` and `/health_generate` generate one token, waiting behind a pause or a weight
  load, and answer 503 after `--health-timeout-s` (SGLang's 20 s); with
  `SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0`, `/health` answers 200 at once.
- The info routes sglang-router 0.3.2 reads to register a worker (`/health`, `/server_info`,
  `/model_info` and their deprecated `/get_` names), `/v1/models`, a non-streaming OpenAI
  `/v1/chat/completions`, and our own `GET /emulator_stats` (requests, prompt and cached tokens,
  the running rids, and the latest ended requests with their finish type and token count).
POSTs through the router need `Content-Type: application/json`; the router re-serializes
`/generate` bodies (it drops a top-level `seed`; `sampling_seed`, `stop_token_ids`, `rid` and `n` pass,
a negative `n` is its own 422) and returns a group's list, or its streamed chunks, unchanged.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import copy
import json
import os
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from .grammar import GrammarBackend
from .model import load_model, model_moe
from .multimodal import AVOID_RETOKENIZE_ENV, ImageReader, build_prompt, decode_image_data, image_data_list
from .protocol import (
    BadRequest,
    Sampling,
    ServerError,
    check_context_length,
    parallel_sample_num,
    parse_sampling,
    trimmed_text,
)
from .scheduler import PAUSE_MODES, Scheduler
from .scheduler import Request as EngineRequest

DEFAULT_MODEL_NAME = "rolloutfleet-test-engine"
DEFAULT_CONTEXT_LENGTH = 32768
DEFAULT_CACHE_CAPACITY_TOKENS = 200_000
HEALTH_TIMEOUT_S = 20.0  # SGLang's HEALTH_CHECK_TIMEOUT
WEIGHTS_FILE = "emulator_weights.json"
ORIGINAL_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"
HEALTH_GENERATION_ENV = "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"
DISCONNECT_POLL_S = 0.5


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    return default if value is None else value.strip().lower() in ("1", "true", "yes")


def write_weights(path: str | os.PathLike, seed: int) -> Path:
    """A checkpoint the emulator can load with /update_weights_from_disk: weights from `seed`."""
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / WEIGHTS_FILE).write_text(json.dumps({"seed": seed}))
    return directory


def read_weights_seed(model_path: str) -> int:
    path = Path(model_path)
    path = path / WEIGHTS_FILE if path.is_dir() else path
    try:
        seed = json.loads(path.read_text())["seed"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BadRequest(f"cannot load weights from {model_path}: {type(exc).__name__}: {exc}") from None
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise BadRequest(f"{path}: seed must be an integer")
    return seed


@dataclass(frozen=True)
class GenerateParams:
    input_ids: list[int]  # the prompt as the engine runs it: with images, each pad expanded
    sampling: Sampling
    rid: str
    return_logprob: bool
    return_text_in_logprobs: bool
    stream: bool
    n: int = 1  # parallel_sample_num: above 1, a group of n samples answered as a list
    return_prompt_token_ids: bool = False
    image_tokens: int = 0
    # The radix cache's keys for the prompt when it differs from input_ids (images: their pad values).
    cache_ids: list[int] | None = None
    grammar: Any = None  # the compiled grammar of sampling.constraint (grammar.py)
    return_routed_experts: bool = False
    routed_experts_start: int = 0  # routed_experts_start_len

    @property
    def parallel(self) -> bool:
        return self.n > 1

    def engine_ids(self, vocab_size: int) -> tuple[list[int], list[int] | None]:
        """(cache keys, model input) of the prompt. The tiny model has no vision encoder: at an
        image's positions it embeds a token drawn from the image's hash, so the output depends on the
        image, as a real model's does."""
        if self.cache_ids is None:
            return list(self.input_ids), None
        return list(self.cache_ids), [t % vocab_size for t in self.cache_ids]


def _json_response(payload: object, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")


def error_response(message: str, status: int = 400) -> Response:
    return _json_response({"error": {"message": message}}, status)


def _bool_field(source: dict, key: str) -> bool:
    value = source.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"{key} must be a boolean")
    return value


def _token_list(value: object, vocab_size: int, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise BadRequest(f"{what} must be a list of integers (batched requests are not supported)")
    bad = [t for t in value if not 0 <= t < vocab_size]
    if bad:
        raise BadRequest(f"{what} holds ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    return value


def parse_generate_request(
    body: object,
    tokenizer,
    eos_token_id: int | None,
    context_length: int,
    images: ImageReader | None = None,
    avoid_retokenize: bool = True,
) -> GenerateParams:
    """Validate an SGLang `/generate` body; raises BadRequest with SGLang's message. With a
    vision-language model directory (`images`), `image_data` expands the prompt (multimodal.py); a
    text model ignores it, as SGLang without a multimodal processor does. CPU-bound with images
    (decoding them): call it off the event loop then."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    has_ids, has_text = body.get("input_ids") is not None, body.get("text") is not None
    if has_ids == has_text:
        raise BadRequest("exactly one of input_ids and text must be given")
    if has_text:
        if not isinstance(body["text"], str):
            raise BadRequest("text must be a string (batched requests are not supported)")
        input_ids = tokenizer.encode(body["text"], add_special_tokens=False)
    else:
        input_ids = _token_list(body["input_ids"], len(tokenizer), "input_ids")
    if not input_ids:
        raise BadRequest("The input_ids must not be empty.")
    n = parallel_sample_num(body.get("sampling_params"))  # normalize_batch_and_arguments, first
    sampling = parse_sampling(body.get("sampling_params"), eos_token_id, len(tokenizer))
    image_items = image_data_list(body.get("image_data"))
    cache_ids, image_tokens = None, 0
    if images is not None and image_items:
        read = [images.read(decode_image_data(item)) for item in image_items]
        prompt, _ = build_prompt(
            input_ids,
            read,
            images.tokens,
            lambda ids: tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False),
            avoid_retokenize,
        )
        input_ids, cache_ids, image_tokens = prompt.input_ids, prompt.cache_ids, prompt.image_tokens
    check_context_length(len(input_ids), sampling.max_new_tokens, context_length)
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise BadRequest("rid must be a string (batched requests are not supported)")
    routed_start = body.get("routed_experts_start_len", 0)
    if (
        isinstance(routed_start, bool)
        or not isinstance(routed_start, int)
        or not 0 <= routed_start <= len(input_ids)
    ):
        raise BadRequest(f"routed_experts_start_len must be in [0, {len(input_ids)}] (the prompt tokens)")
    return GenerateParams(
        input_ids=input_ids,
        sampling=sampling,
        rid=rid or uuid.uuid4().hex,
        return_logprob=_bool_field(body, "return_logprob"),
        return_text_in_logprobs=_bool_field(body, "return_text_in_logprobs"),
        stream=_bool_field(body, "stream"),
        n=n,
        return_prompt_token_ids=_bool_field(body, "return_prompt_token_ids"),
        image_tokens=image_tokens,
        cache_ids=cache_ids,
        return_routed_experts=_bool_field(body, "return_routed_experts"),
        routed_experts_start=routed_start,
    )


def routed_experts_field(params: GenerateParams, request: EngineRequest) -> str | None:
    """`meta_info.routed_experts` of an ended request: base64 of the int32 rows of positions
    [routed_experts_start_len, prompt + output - 1); None if it was never forwarded."""
    rows = request.routed_rows()
    if rows is None:
        return None
    end = len(params.input_ids) + len(request.output_ids) - 1
    chosen = np.ascontiguousarray(rows[params.routed_experts_start : max(end, params.routed_experts_start)])
    return base64.b64encode(chosen.astype("<i4").tobytes()).decode("ascii")


def generate_answer(
    params: GenerateParams,
    request: EngineRequest,
    tokenizer,
    weight_version: str,
    routed_experts: bool = False,
) -> dict:
    """The SGLang `/generate` answer for the request's output so far (also one streamed chunk);
    `meta_info.id` is the engine request's rid (a sample's own, in a group). `routed_experts`: the
    engine captures routing (`--enable-return-routed-experts`)."""
    output_ids = list(request.output_ids)
    logprobs = list(request.logprobs)[: len(output_ids)]
    meta_info: dict = {
        "id": request.rid,
        "finish_reason": request.finish,
        "prompt_tokens": len(params.input_ids),
        "completion_tokens": len(output_ids),
        "cached_tokens": request.cached_tokens,
        "weight_version": weight_version,
        "e2e_latency": time.perf_counter() - request.created,
    }
    if params.image_tokens:  # only for requests that consumed images
        meta_info["image_tokens"] = params.image_tokens
    if routed_experts and params.return_routed_experts and request.finish is not None:
        routing = routed_experts_field(params, request)
        if routing is not None:
            meta_info["routed_experts"] = routing
    if params.return_logprob:
        meta_info["output_token_logprobs"] = [
            [logprob, token, tokenizer.decode([token]) if params.return_text_in_logprobs else None]
            for logprob, token in zip(logprobs, output_ids, strict=True)
        ]
    text = tokenizer.decode(output_ids, skip_special_tokens=True)
    answer = {
        "text": trimmed_text(text, request.finish, params.sampling),
        "output_ids": output_ids,
        "meta_info": meta_info,
    }
    if params.return_prompt_token_ids:  # the expanded prompt, in every answer and streamed chunk
        answer["prompt_token_ids"] = list(params.input_ids)
    return answer


def _message_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
        for part in content
    ):
        return "".join(part["text"] for part in content)
    raise BadRequest("message content must be a string or a list of text parts")


def parse_chat_request(body: object, tokenizer, eos_token_id: int | None) -> tuple[GenerateParams, bool]:
    """Validate an OpenAI chat.completions body; returns the generation and whether to return logprobs."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if body.get("stream"):
        raise BadRequest("stream=true is not supported by the emulator's chat endpoint")
    if body.get("n") not in (None, 1):
        raise BadRequest("only n=1 is supported")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list")
    conversation = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest("each message must be an object with a string role")
        conversation.append({"role": message["role"], "content": _message_text(message.get("content"))})
    prompt = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    input_ids = tokenizer.encode(prompt, add_special_tokens=False)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    sampling = {"max_new_tokens": body.get(key)} if body.get(key) is not None else {}
    for name in ("temperature", "top_p"):
        if body.get(name) is not None:
            sampling[name] = body[name]
    if body.get("seed") is not None:
        sampling["sampling_seed"] = body["seed"]
    params = GenerateParams(
        input_ids=input_ids,
        sampling=parse_sampling(sampling, eos_token_id, len(tokenizer)),
        rid=f"chatcmpl-{uuid.uuid4().hex}",
        return_logprob=True,
        return_text_in_logprobs=False,
        stream=False,
    )
    return params, _bool_field(body, "logprobs")


def chat_answer(
    params: GenerateParams, request: EngineRequest, want_logprobs: bool, tokenizer, model_name: str
) -> dict:
    logprobs = None
    if want_logprobs:
        logprobs = {
            "content": [
                {"token": tokenizer.decode([token]), "logprob": logprob, "bytes": None, "top_logprobs": []}
                for token, logprob in zip(request.output_ids, request.logprobs, strict=True)
            ]
        }
    finish = (request.finish or {}).get("type", "stop")
    completion_tokens = len(request.output_ids)
    return {
        "id": params.rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": tokenizer.decode(request.output_ids, skip_special_tokens=True),
                },
                "logprobs": logprobs,
                "finish_reason": finish,
            }
        ],
        "usage": {
            "prompt_tokens": len(params.input_ids),
            "completion_tokens": completion_tokens,
            "total_tokens": len(params.input_ids) + completion_tokens,
        },
    }


def _version() -> str:
    try:
        return metadata.version("rolloutfleet")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def _sse(payload: object) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


async def _merge_streams(streams: list[AsyncGenerator[dict]]) -> AsyncIterator[tuple[int, dict]]:
    """(index, chunk) from several streams as each chunk comes, as `_stream_batch_responses` interleaves
    a group's samples (the index is the sample's place in the group)."""
    pending = {asyncio.ensure_future(anext(stream)): i for i, stream in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = pending.pop(task)
                try:
                    chunk = task.result()
                except StopAsyncIteration:
                    continue
                yield index, chunk
                pending[asyncio.ensure_future(anext(streams[index]))] = index
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await asyncio.gather(*(stream.aclose() for stream in streams), return_exceptions=True)


def create_app(
    tokenizer_path: str,
    seed: int = 0,
    delay_s: float = 0.0,
    model_name: str = DEFAULT_MODEL_NAME,
    *,
    context_length: int = DEFAULT_CONTEXT_LENGTH,
    cache_capacity_tokens: int = DEFAULT_CACHE_CAPACITY_TOKENS,
    token_delay_s: float = 0.0,
    weight_version: str = "default",
    deterministic_inference: bool = False,
    health_timeout_s: float = HEALTH_TIMEOUT_S,
    update_delay_s: float = 0.0,
    routed_experts: bool = False,
) -> FastAPI:
    """The emulator for the tokenizer in `tokenizer_path` and the model of `seed`. `delay_s` waits
    before each request is scheduled; `token_delay_s` is the time per decode step; `routed_experts`:
    capture routing (`--enable-return-routed-experts`; a model directory with experts)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    eos_token_id = tokenizer.eos_token_id
    # A vision-language model directory (config.json and preprocessor_config.json beside the tokenizer).
    images = ImageReader(tokenizer_path) if ImageReader.serves(tokenizer_path) else None
    avoid_retokenize = _env_flag(AVOID_RETOKENIZE_ENV, True)

    grammars = GrammarBackend(tokenizer, len(tokenizer), [] if eos_token_id is None else [eos_token_id])
    moe = model_moe(tokenizer_path)
    if routed_experts and moe is None:
        raise ValueError(f"{tokenizer_path}/config.json names no experts: nothing to route")

    def model_for(weights_seed: int):
        return load_model(len(tokenizer), seed=weights_seed, eos_token_id=eos_token_id, moe=moe)

    scheduler = Scheduler(
        model_for(seed),
        lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        cache_capacity_tokens,
        token_delay_s=token_delay_s,
        weight_version=weight_version,
        original_logprobs=_env_flag(ORIGINAL_LOGPROB_ENV, False),
        deterministic=deterministic_inference,
        model_factory=model_for,
        update_delay_s=update_delay_s,
    )
    health_generates = _env_flag(HEALTH_GENERATION_ENV, True)
    version = _version()
    state = {"seed": seed}
    app = FastAPI(title="rolloutfleet SGLang emulator (test stand-in for SGLang)")
    app.state.scheduler = scheduler

    async def read_json(request: Request) -> object:
        raw = await request.body()
        if not raw.strip():
            return {}
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise BadRequest(f"the request body is not valid JSON: {exc}") from exc

    @app.exception_handler(BadRequest)
    async def bad_request(_request: Request, exc: BadRequest) -> Response:
        return error_response(str(exc))

    @app.exception_handler(ServerError)
    async def server_error(_request: Request, _exc: ServerError) -> Response:
        return Response("Internal Server Error", status_code=500, media_type="text/plain")

    def start(params: GenerateParams) -> tuple[list[EngineRequest], asyncio.Task]:
        """The engine requests of a /generate (one, or a group's n samples in sample order) and the
        task that schedules them. A group's prefill-only request and each sample get rids of their own
        (`tmp_obj.regenerate_rid()`, a uuid4 hex), never the request's `rid`."""
        keys, embed = params.engine_ids(len(tokenizer))

        def grammar():  # each request follows the grammar on its own
            return None if params.grammar is None else grammars.matcher(params.grammar)

        if not params.parallel:
            single = EngineRequest(params.rid, keys, params.sampling, embed_ids=embed, grammar=grammar())
            return [single], asyncio.create_task(scheduler.submit(single))
        prefill = EngineRequest(
            uuid.uuid4().hex, list(keys), replace(params.sampling, max_new_tokens=0), embed_ids=embed
        )
        samples = [
            EngineRequest(uuid.uuid4().hex, list(keys), params.sampling, embed_ids=embed, grammar=grammar())
            for _ in range(params.n)
        ]
        return samples, asyncio.create_task(scheduler.submit_group(prefill, samples))

    async def abort_all_of(requests: list[EngineRequest]) -> None:
        for engine_request in requests:  # each of a group's generators aborts its own rid
            await scheduler.abort(engine_request.rid, "Abort: the client disconnected.")

    async def run(params: GenerateParams, http: Request | None) -> list[EngineRequest]:
        """Schedule the request(s); a client that disconnects aborts them (as SGLang does)."""
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        requests, task = start(params)
        while http is not None and not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await http.is_disconnected():
                await abort_all_of(requests)
                break
        await task
        return requests

    async def sample_chunks(params: GenerateParams, engine_request: EngineRequest) -> AsyncGenerator[dict]:
        """One request's streamed answers: one per token with the cumulative text and ids, as SGLang
        streams by default; a chunk is made once the next step is known, so the last carries the finish."""
        pending: int | None = None
        while True:
            count = await engine_request.steps.get()
            if pending is not None:
                view = copy.copy(engine_request)
                view.output_ids = engine_request.output_ids[:pending]
                view.finish = engine_request.finish if count is None else None
                yield generate_answer(params, view, tokenizer, scheduler.weight_version, routed_experts)
            elif count is None:  # ended before its first token
                yield generate_answer(
                    params, engine_request, tokenizer, scheduler.weight_version, routed_experts
                )
            if count is None:
                return
            pending = count

    async def parse_generate(body: object) -> GenerateParams:
        parse = (body, tokenizer, eos_token_id, context_length, images, avoid_retokenize)
        if images is not None and isinstance(body, dict) and body.get("image_data") is not None:
            params = await asyncio.to_thread(parse_generate_request, *parse)  # decoding images: off the loop
        else:
            params = parse_generate_request(*parse)
        if params.sampling.constraint is not None:  # compiling is CPU work: off the loop
            params = replace(
                params, grammar=await asyncio.to_thread(grammars.compile, *params.sampling.constraint)
            )
        return params

    @app.post("/generate")
    async def generate_endpoint(request: Request) -> Response:
        params = await parse_generate(await read_json(request))
        if not params.stream:
            done = await run(params, request)
            answers = [
                generate_answer(params, r, tokenizer, scheduler.weight_version, routed_experts) for r in done
            ]
            # _collect_batch_responses: a group answers the list of its samples' results, in order.
            return _json_response(answers if params.parallel else answers[0])

        async def chunks() -> AsyncIterator[bytes]:
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            requests, task = start(params)
            try:
                if not params.parallel:
                    async for answer in sample_chunks(params, requests[0]):
                        yield _sse(answer)
                else:
                    streams = [sample_chunks(params, r) for r in requests]
                    async for index, answer in _merge_streams(streams):
                        # _stream_batch_responses: each chunk names its sample's place in the group
                        yield _sse({**answer, "index": index})
                yield b"data: [DONE]\n\n"
            finally:
                if not task.done():  # the client went away: abort, as SGLang does
                    await abort_all_of(requests)
                    task.cancel()

        return StreamingResponse(chunks(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        params, want_logprobs = parse_chat_request(await read_json(request), tokenizer, eos_token_id)
        (done,) = await run(params, request)
        return _json_response(chat_answer(params, done, want_logprobs, tokenizer, model_name))

    async def health_generation() -> Response:
        probe = EngineRequest(
            f"HEALTH_CHECK_{uuid.uuid4().hex}",
            [0],
            parse_sampling({"max_new_tokens": 1, "temperature": 0}, eos_token_id, len(tokenizer)),
        )
        try:
            await asyncio.wait_for(scheduler.submit(probe), health_timeout_s)
        except TimeoutError:
            with contextlib.suppress(Exception):
                await scheduler.abort(probe.rid)
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/health")
    async def health() -> Response:
        if not health_generates:  # SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0: liveness only
            return Response(status_code=200)
        return await health_generation()

    @app.get("/health_generate")
    async def health_generate() -> Response:
        return await health_generation()

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> Response:
        body = await read_json(request)
        mode = (body or {}).get("mode", "abort") if isinstance(body, dict) else None
        if mode not in PAUSE_MODES:
            raise BadRequest(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        await scheduler.pause(mode)
        return _json_response({"message": "Generation paused successfully.", "mode": mode})

    @app.post("/continue_generation")
    async def continue_generation() -> Response:
        await scheduler.resume()
        return _json_response({"message": "Generation continued successfully."})

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> Response:
        body = await read_json(request)
        if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
            raise BadRequest("model_path must be a string")
        new_seed = read_weights_seed(body["model_path"])
        weight_version = body.get("weight_version")
        if weight_version is not None and not isinstance(weight_version, str):
            raise BadRequest("weight_version must be a string")
        answer = await scheduler.update_weights(
            new_seed, weight_version, bool(body.get("abort_all_requests"))
        )
        if answer["success"]:
            state["seed"] = new_seed
        return _json_response(answer, 200 if answer["success"] else 400)

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> Response:
        body = await read_json(request)
        if not isinstance(body, dict) or not isinstance(body.get("new_version"), str):
            raise BadRequest("new_version must be a string")
        await scheduler.set_weight_version(body["new_version"], bool(body.get("abort_all_requests", True)))
        return _json_response(
            {"success": True, "message": "Weight version updated.", "new_version": body["new_version"]}
        )

    @app.get("/get_weight_version")
    async def get_weight_version() -> Response:
        return _json_response({"weight_version": scheduler.weight_version})

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await read_json(request)
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        if body.get("abort_all"):
            await scheduler.abort(None)
        elif isinstance(body.get("rid"), str):
            await scheduler.abort(body["rid"])
        else:
            raise BadRequest("give rid or abort_all")
        return Response(status_code=200)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        scheduler.cache.reset()
        return Response("Cache flushed.", status_code=200)

    @app.get("/emulator_stats")
    async def emulator_stats() -> Response:
        return _json_response(
            {
                **scheduler.stats,
                "running": len(scheduler.running),
                "running_rids": [r.rid for r in scheduler.running],
                "ended": list(scheduler.ended),  # the latest, oldest first: rid, finish, output_tokens
                "paused": scheduler.paused,
                "cache_tokens": scheduler.cache.size,
                "weight_version": scheduler.weight_version,
                "weights_seed": state["seed"],
            }
        )

    def model_info() -> dict:
        # model_path is the tokenizer directory on purpose: the router loads its tokenizer from
        # model_path and, if that is no local directory, tries to download it from the hub.
        return {
            "model_path": tokenizer_path,
            "tokenizer_path": tokenizer_path,
            "served_model_name": model_name,
            "is_generation": True,
            "weight_version": scheduler.weight_version,
        }

    async def model_info_endpoint() -> Response:
        return _json_response(model_info())

    async def server_info_endpoint(request: Request) -> Response:
        host, port = request.scope.get("server") or (None, None)
        return _json_response(
            {
                **model_info(),
                "host": host,
                "port": port,
                "version": version,
                "engine": "rolloutfleet-sglang-emulator",
                "seed": state["seed"],
                "delay_s": delay_s,
                "vocab_size": len(tokenizer),
                "context_length": context_length,
                "max_req_input_len": context_length - 1,
                "tp_size": 1,
                "dp_size": 1,
            }
        )

    for path in ("/model_info", "/get_model_info"):
        app.add_api_route(path, model_info_endpoint, methods=["GET"])
    for path in ("/server_info", "/get_server_info"):
        app.add_api_route(path, server_info_endpoint, methods=["GET"])

    @app.get("/v1/models")
    async def models() -> Response:
        entry = {"id": model_name, "object": "model", "created": 0, "owned_by": "rolloutfleet"}
        return _json_response({"object": "list", "data": [entry]})

    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="rolloutfleet-sglang-emulator",
        description="SGLang emulator: a test stand-in for a GPU SGLang server (tiny CPU model).",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--tokenizer-path", required=True)
    parser.add_argument("--seed", type=int, default=0, help="the model's weights are drawn from it")
    parser.add_argument("--delay-s", type=float, default=0.0, help="wait before scheduling each request")
    parser.add_argument("--token-delay-s", type=float, default=0.0, help="time per decode step")
    parser.add_argument("--model-name", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--context-length", type=int, default=DEFAULT_CONTEXT_LENGTH)
    parser.add_argument("--cache-capacity-tokens", type=int, default=DEFAULT_CACHE_CAPACITY_TOKENS)
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--enable-deterministic-inference", action="store_true")
    parser.add_argument("--health-timeout-s", type=float, default=HEALTH_TIMEOUT_S)
    parser.add_argument("--update-delay-s", type=float, default=0.0, help="time to load weights")
    parser.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="capture routing for return_routed_experts (a model directory whose config.json names experts)",
    )
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)

    import torch
    import uvicorn

    # The model is tiny; more threads only contend with the other processes on the machine.
    torch.set_num_threads(1)
    app = create_app(
        args.tokenizer_path,
        seed=args.seed,
        delay_s=args.delay_s,
        model_name=args.model_name,
        context_length=args.context_length,
        cache_capacity_tokens=args.cache_capacity_tokens,
        token_delay_s=args.token_delay_s,
        weight_version=args.weight_version,
        deterministic_inference=args.enable_deterministic_inference,
        health_timeout_s=args.health_timeout_s,
        update_delay_s=args.update_delay_s,
        routed_experts=args.enable_return_routed_experts,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
