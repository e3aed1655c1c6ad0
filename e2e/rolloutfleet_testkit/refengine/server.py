"""HTTP server of the CPU reference engine: a TEST STAND-IN for a GPU SGLang server.

It speaks the subset of SGLang's HTTP protocol that the proxy and the sglang-router use:
`/generate` (token ids in, token ids and logprobs out, optionally streamed), the health and info
endpoints the router polls, and a non-streaming OpenAI `/v1/chat/completions`.

What sglang-router 0.3.2 asks of a worker given with `--worker-urls` (read from its log and this
engine's access log): `GET /health` must answer 200 (registration and periodic health checks);
it then reads `GET /server_info` and `GET /model_info` (falling back to the deprecated
`/get_server_info` and `/get_model_info` on 404). Those two are optional: without them the
worker still registers, under the model id "unknown". From them it keeps `served_model_name`
(the worker's model id), `model_path`, `tp_size` and `dp_size`, and it loads a tokenizer from
`model_path`, downloading from the Hugging Face hub when that is not a local directory. It also
probes the port for gRPC once, which uvicorn logs as "Invalid HTTP request received"; harmless.
POSTs through the router need `Content-Type: application/json` (else 415). It re-serializes
`/generate` bodies: `sampling_params.seed` and a top-level `seed` are dropped, while
`sampling_params.sampling_seed`, `stop_token_ids`, `return_logprob`, `logprob_start_len`,
`return_text_in_logprobs` and `rid` pass through.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from importlib import metadata

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from rolloutfleet_testkit.refengine.model import (
    GenerationResult,
    TinyCausalLM,
    generate,
    iter_generate,
    load_model,
)

DEFAULT_MODEL_NAME = "rolloutfleet-test-engine"
# SGLang's defaults for a /generate request without sampling_params.
DEFAULT_MAX_NEW_TOKENS = 128
DEFAULT_TEMPERATURE = 1.0
# SGLang treats temperatures below this as greedy decoding.
GREEDY_EPS = 1e-6


class BadRequest(ValueError):
    """A request the engine refuses with HTTP 400."""


@dataclass(frozen=True)
class GenerateParams:
    input_ids: list[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop_token_ids: frozenset[int]
    return_logprob: bool
    return_text_in_logprobs: bool
    stream: bool


# ---------------------------------------------------------------------------------------------
# Request parsing and answer building: pure functions of their arguments.


def _json_response(payload: object, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")


def error_response(message: str, status: int = 400) -> Response:
    return _json_response({"error": {"message": message}}, status)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _token_list(value: object, vocab_size: int, what: str) -> list[int]:
    if not isinstance(value, list) or not all(_is_int(t) for t in value):
        raise BadRequest(f"{what} must be a list of integers (batched requests are not supported)")
    bad = [t for t in value if not 0 <= t < vocab_size]
    if bad:
        raise BadRequest(f"{what} holds ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    return value


def _int_field(source: dict, key: str, default: int | None, minimum: int | None = None) -> int | None:
    value = source.get(key)
    if value is None:
        return default
    if not _is_int(value):
        raise BadRequest(f"{key} must be an integer")
    if minimum is not None and value < minimum:
        raise BadRequest(f"{key} must be >= {minimum}")
    return value


def _sampling(
    source: dict, max_tokens_key: str, default_temperature: float
) -> tuple[int, float, float, int | None]:
    max_new_tokens = _int_field(source, max_tokens_key, DEFAULT_MAX_NEW_TOKENS, minimum=0)
    temperature = source.get("temperature", default_temperature)
    temperature = default_temperature if temperature is None else temperature
    if not _is_number(temperature) or temperature < 0:
        raise BadRequest("temperature must be a number >= 0")
    top_p = 1.0 if source.get("top_p") is None else source["top_p"]
    if not _is_number(top_p) or not 0 < top_p <= 1:
        raise BadRequest("top_p must be a number in (0, 1]")
    seed = _int_field(source, "seed", None)
    return max_new_tokens, 0.0 if temperature < GREEDY_EPS else float(temperature), float(top_p), seed


def _bool_field(source: dict, key: str) -> bool:
    value = source.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"{key} must be a boolean")
    return value


def parse_generate_request(body: object, tokenizer, eos_token_id: int | None) -> GenerateParams:
    """Validate an SGLang `/generate` body; raises BadRequest with a message for the client."""
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
        raise BadRequest("the prompt must not be empty")

    sampling_params = body.get("sampling_params") or {}
    if not isinstance(sampling_params, dict):
        raise BadRequest("sampling_params must be an object")
    max_new_tokens, temperature, top_p, _ = _sampling(sampling_params, "max_new_tokens", DEFAULT_TEMPERATURE)
    # sampling_params.sampling_seed is SGLang's name and the only one sglang-router 0.3.2 passes
    # on (it drops sampling_params.seed and a top-level seed); the others serve direct callers.
    seed = None
    for source, key in ((sampling_params, "sampling_seed"), (sampling_params, "seed"), (body, "seed")):
        if seed is None:
            seed = _int_field(source, key, None)
    stops = sampling_params.get("stop_token_ids") or []
    stop_token_ids = set(_token_list(stops, len(tokenizer), "stop_token_ids"))
    # As in SGLang, stop_token_ids add to the EOS token rather than replace it.
    if eos_token_id is not None:
        stop_token_ids.add(eos_token_id)
    _int_field(body, "logprob_start_len", -1, minimum=-1)  # accepted; input logprobs are not served
    return GenerateParams(
        input_ids=input_ids,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        stop_token_ids=frozenset(stop_token_ids),
        return_logprob=_bool_field(body, "return_logprob"),
        return_text_in_logprobs=_bool_field(body, "return_text_in_logprobs"),
        stream=_bool_field(body, "stream"),
    )


def finish_reason(output_ids: list[int], params: GenerateParams) -> dict | None:
    """SGLang's finish_reason for the output so far, or None while generation goes on."""
    if output_ids and output_ids[-1] in params.stop_token_ids:
        return {"type": "stop", "matched": output_ids[-1]}
    if len(output_ids) >= params.max_new_tokens:
        return {"type": "length", "length": params.max_new_tokens}
    return None


def generate_answer(
    params: GenerateParams,
    output_ids: list[int],
    logprobs: list[float],
    tokenizer,
    request_id: str,
    started: float,
) -> dict:
    """The SGLang `/generate` answer (also one streamed chunk, with the output so far)."""
    meta_info = {
        "id": request_id,
        "finish_reason": finish_reason(output_ids, params),
        "prompt_tokens": len(params.input_ids),
        "completion_tokens": len(output_ids),
        "cached_tokens": 0,
        "e2e_latency": time.perf_counter() - started,
    }
    if params.return_logprob:
        meta_info["output_token_logprobs"] = [
            [logprob, token, tokenizer.decode([token]) if params.return_text_in_logprobs else None]
            for logprob, token in zip(logprobs, output_ids, strict=True)
        ]
    return {
        "text": tokenizer.decode(output_ids, skip_special_tokens=True),
        "output_ids": output_ids,
        "meta_info": meta_info,
    }


def _message_text(content: object) -> str:
    if isinstance(content, str):
        return content
    # OpenAI content parts: only text parts exist for this text-only model.
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
        for part in content
    ):
        return "".join(part["text"] for part in content)
    raise BadRequest("message content must be a string or a list of text parts")


def parse_chat_request(body: object, tokenizer, eos_token_id: int | None) -> tuple[GenerateParams, bool]:
    """Validate an OpenAI chat.completions body; returns the generation and whether to return
    logprobs."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if body.get("stream"):
        raise BadRequest("stream=true is not supported by the reference engine's chat endpoint")
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
    max_new_tokens, temperature, top_p, seed = _sampling(body, key, DEFAULT_TEMPERATURE)
    params = GenerateParams(
        input_ids=input_ids,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        stop_token_ids=frozenset(() if eos_token_id is None else (eos_token_id,)),
        return_logprob=True,
        return_text_in_logprobs=False,
        stream=False,
    )
    return params, _bool_field(body, "logprobs")


def chat_answer(
    params: GenerateParams, result: GenerationResult, want_logprobs: bool, tokenizer, model_name: str
) -> dict:
    logprobs = None
    if want_logprobs:
        logprobs = {
            "content": [
                {"token": tokenizer.decode([token]), "logprob": logprob, "bytes": None, "top_logprobs": []}
                for token, logprob in zip(result.output_ids, result.logprobs, strict=True)
            ]
        }
    completion_tokens = len(result.output_ids)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": tokenizer.decode(result.output_ids, skip_special_tokens=True),
                },
                "logprobs": logprobs,
                "finish_reason": result.finish,
            }
        ],
        "usage": {
            "prompt_tokens": len(params.input_ids),
            "completion_tokens": completion_tokens,
            "total_tokens": len(params.input_ids) + completion_tokens,
        },
    }


# ---------------------------------------------------------------------------------------------
# The engine: one model, one generation at a time.


class Engine:
    """Runs generations one at a time in a worker thread so the event loop stays responsive."""

    def __init__(self, model: TinyCausalLM, delay_s: float) -> None:
        self.model = model
        self.delay_s = delay_s
        # One generation at a time, like a single GPU replica without batching; waiting requests
        # queue here instead of piling threads onto two CPU cores.
        self._lock = asyncio.Lock()

    async def _delay(self) -> None:
        # Before taking the lock, so concurrent requests overlap their delays the way a slow
        # upstream serves them.
        if self.delay_s > 0:
            await asyncio.sleep(self.delay_s)

    @staticmethod
    def _args(params: GenerateParams) -> tuple:
        return (
            params.input_ids,
            params.max_new_tokens,
            params.temperature,
            params.top_p,
            params.seed,
            params.stop_token_ids,
        )

    async def generate(self, params: GenerateParams) -> GenerationResult:
        await self._delay()
        async with self._lock:
            return await asyncio.to_thread(generate, self.model, *self._args(params))

    async def stream(self, params: GenerateParams) -> AsyncIterator[tuple[int, float]]:
        """Yield (token, logprob) as each is computed; the lock is held until the stream ends or
        the consumer goes away."""
        await self._delay()
        async with self._lock:
            steps = iter_generate(self.model, *self._args(params))
            while (step := await asyncio.to_thread(next, steps, None)) is not None:
                yield step


# ---------------------------------------------------------------------------------------------
# The HTTP application.


def _version() -> str:
    try:
        return metadata.version("rolloutfleet")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def _sse(payload: object) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def create_app(
    tokenizer_path: str,
    seed: int = 0,
    delay_s: float = 0.0,
    model_name: str = DEFAULT_MODEL_NAME,
) -> FastAPI:
    """The reference engine app for the tokenizer in tokenizer_path and the model of `seed`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    eos_token_id = tokenizer.eos_token_id
    engine = Engine(load_model(len(tokenizer), seed=seed, eos_token_id=eos_token_id), delay_s)
    version = _version()
    app = FastAPI(title="rolloutfleet reference engine (test stand-in for SGLang)")

    async def read_json(request: Request) -> object:
        try:
            return orjson.loads(await request.body())
        except orjson.JSONDecodeError as exc:
            raise BadRequest(f"the request body is not valid JSON: {exc}") from exc

    @app.exception_handler(BadRequest)
    async def bad_request(_request: Request, exc: BadRequest) -> Response:
        return error_response(str(exc))

    @app.post("/generate")
    async def generate_endpoint(request: Request) -> Response:
        started = time.perf_counter()
        params = parse_generate_request(await read_json(request), tokenizer, eos_token_id)
        request_id = uuid.uuid4().hex
        if not params.stream:
            result = await engine.generate(params)
            answer = generate_answer(
                params, result.output_ids, result.logprobs, tokenizer, request_id, started
            )
            return _json_response(answer)

        async def chunks() -> AsyncIterator[bytes]:
            output_ids: list[int] = []
            logprobs: list[float] = []
            if params.max_new_tokens == 0:
                yield _sse(generate_answer(params, [], [], tokenizer, request_id, started))
            # aclosing: a client that goes away must release the engine lock now, not at GC.
            async with aclosing(engine.stream(params)) as steps:
                async for token, logprob in steps:
                    output_ids.append(token)
                    logprobs.append(logprob)
                    # Cumulative text and ids in every chunk, as SGLang streams by default.
                    answer = generate_answer(params, output_ids, logprobs, tokenizer, request_id, started)
                    yield _sse(answer)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        params, want_logprobs = parse_chat_request(await read_json(request), tokenizer, eos_token_id)
        result = await engine.generate(params)
        return _json_response(chat_answer(params, result, want_logprobs, tokenizer, model_name))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        # Like SGLang, prove the model can actually produce a token.
        probe = parse_generate_request(
            {"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0}},
            tokenizer,
            eos_token_id,
        )
        await engine.generate(probe)
        return Response(status_code=200)

    def model_info() -> dict:
        # model_path is the tokenizer directory on purpose: the router loads its tokenizer from
        # model_path and, if that is no local directory, tries to download it from the hub.
        return {
            "model_path": tokenizer_path,
            "tokenizer_path": tokenizer_path,
            "served_model_name": model_name,
            "is_generation": True,
        }

    async def model_info_endpoint() -> Response:
        return _json_response(model_info())

    async def server_info_endpoint(request: Request) -> Response:
        # The bound address comes from the connection, so the app needs no port argument.
        host, port = request.scope.get("server") or (None, None)
        return _json_response(
            {
                **model_info(),
                "served_model_name": model_name,
                "host": host,
                "port": port,
                "version": version,
                "engine": "rolloutfleet-refengine",
                "seed": seed,
                "delay_s": delay_s,
                "vocab_size": len(tokenizer),
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
        prog="rolloutfleet-refengine",
        description="CPU reference engine: a test stand-in for a GPU SGLang server.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--tokenizer-path", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--delay-s", type=float, default=0.0)
    parser.add_argument("--model-name", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)

    import torch
    import uvicorn

    # The model is tiny; more threads only contend with the other processes on the machine.
    torch.set_num_threads(1)
    app = create_app(args.tokenizer_path, seed=args.seed, delay_s=args.delay_s, model_name=args.model_name)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
