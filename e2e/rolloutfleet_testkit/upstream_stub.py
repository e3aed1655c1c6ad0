"""Fixed-latency upstream: a TEST STAND-IN for an SGLang server's `/generate`, for benchmarks
and latency-controlled tests.

Every `/generate` waits `latency_s` (asyncio, so any number of requests wait concurrently) and
answers a fixed token sequence in SGLang's answer shape. It is a bare ASGI app with orjson and
no model, so its own CPU cost per request stays far below the proxy's that it is used to measure.

With `RuledReplies`, a rule writes the reply for each prompt instead (tests that need replies in a
model family's own format, or a tool-using model's behaviour): a reply ending on one of the stop
ids finishes as SGLang reports a matched stop token, `{"type": "stop", "matched": <id>}`.

With `routing` (layers, top_k, experts) it answers `return_routed_experts` as SGLang does
(`meta_info.routed_experts`: base64 of int32 rows for positions [`routed_experts_start_len`,
prompt + output - 1)), every row the same: what the proxy's routing replay costs, not a model's.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import orjson

from .asgi import lifespan, read_body, send_json
from .sglang_args import launch_flags

SERVED_MODEL_NAME = "rolloutfleet-upstream-stub"
# Every stub token gets this logprob (the stub has no model; a constant is easy to check).
TOKEN_LOGPROB = -0.5


@dataclass(frozen=True)
class RuledReplies:
    """Replies a rule writes for a prompt's input ids (None from the rule: the fixed tokens)."""

    reply_for: Callable[[list[int]], list[int] | None]
    stop_ids: frozenset[int] = frozenset()
    decode: Callable[[list[int]], str] | None = None  # SGLang's `text`; a placeholder without it


def reply_logprobs(count: int) -> list[float]:
    """Distinct, checkable logprobs for a ruled reply of `count` tokens."""
    return [-0.01 * (i + 1) for i in range(count)]


def parallel_samples(body: object) -> int:
    """How many samples a request asks for: SGLang reads `sampling_params.n` and turns a single
    prompt into a group of that many when it is above 1 (GenerateReqInput._handle_parallel_sampling)."""
    sampling_params = body.get("sampling_params") if isinstance(body, dict) else None
    n = sampling_params.get("n", 1) if isinstance(sampling_params, dict) else 1
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1


def routed_experts(body: dict, prompt: int, outputs: int, routing: tuple[int, int, int]) -> str:
    """SGLang's `meta_info.routed_experts` for a request: one fixed row per position from the start."""
    layers, top_k, experts = routing
    start = body.get("routed_experts_start_len", 0)
    rows = max(0, prompt + outputs - 1 - (start if isinstance(start, int) else 0))
    row = (bytes(range(top_k)) * layers)[: layers * top_k]
    values = bytes(b % experts for b in row)
    return base64.b64encode(b"".join(v.to_bytes(4, "little") for v in values) * rows).decode()


def stub_answer(
    body: object,
    output_tokens: int,
    token_id: int,
    latency_s: float,
    ruled: RuledReplies | None = None,
    routing: tuple[int, int, int] | None = None,
) -> dict:
    """The SGLang `/generate` answer for a request body (raises ValueError for a bad body)."""
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    sampling_params = body.get("sampling_params") or {}
    if not isinstance(sampling_params, dict):
        raise ValueError("sampling_params must be an object")
    count = output_tokens
    max_new_tokens = sampling_params.get("max_new_tokens")
    if isinstance(max_new_tokens, int) and not isinstance(max_new_tokens, bool):
        count = max(0, min(count, max_new_tokens))
    input_ids = body.get("input_ids")
    output_ids = [token_id] * count
    logprobs = [TOKEN_LOGPROB] * count
    finish: dict = {"type": "length", "length": count}
    reply = ruled.reply_for(input_ids) if ruled is not None and isinstance(input_ids, list) else None
    if reply is not None:
        output_ids, count, logprobs = reply, len(reply), reply_logprobs(len(reply))
        if reply and reply[-1] in ruled.stop_ids:  # type: ignore[union-attr]
            finish = {"type": "stop", "matched": reply[-1]}
    meta_info = {
        "id": uuid.uuid4().hex,
        "finish_reason": finish,
        "prompt_tokens": len(input_ids) if isinstance(input_ids, list) else 0,
        "completion_tokens": count,
        "cached_tokens": 0,
        "e2e_latency": latency_s,
    }
    if routing is not None and body.get("return_routed_experts"):
        meta_info["routed_experts"] = routed_experts(body, meta_info["prompt_tokens"], count, routing)
    if body.get("return_logprob"):
        meta_info["output_token_logprobs"] = [
            [lp, i, None] for lp, i in zip(logprobs, output_ids, strict=True)
        ]
    if ruled is not None and ruled.decode is not None:
        text = ruled.decode(output_ids)
    else:  # no tokenizer: a readable placeholder, one piece per token
        text = "".join(f"<{i}>" for i in output_ids)
    return {"text": text, "output_ids": output_ids, "meta_info": meta_info}


class UpstreamStub:
    """The ASGI app. `requests` counts the `/generate` answers sent."""

    def __init__(
        self,
        latency_s: float,
        output_tokens: int,
        token_id: int = 42,
        ruled: RuledReplies | None = None,
        routing: tuple[int, int, int] | None = None,
    ) -> None:
        if latency_s < 0 or output_tokens < 0:
            raise ValueError("latency_s and output_tokens must be >= 0")
        self.ruled = ruled
        self.routing = routing
        self.latency_s = latency_s
        self.output_tokens = output_tokens
        self.token_id = token_id
        self.requests = 0

    def _info(self, scope: dict) -> dict:
        # No model_path on purpose: sglang-router would try to fetch a tokenizer for it.
        host, port = scope.get("server") or (None, None)
        return {
            "served_model_name": SERVED_MODEL_NAME,
            "is_generation": True,
            "latency_s": self.latency_s,
            "output_tokens": self.output_tokens,
            "token_id": self.token_id,
            "host": host,
            "port": port,
            "version": "stub",
        }

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        if path == "/generate":
            if method != "POST":
                await send_json(send, 405, {"error": {"message": "use POST"}})
                return
            await self._generate(await read_body(receive), send)
            return
        if method != "GET":
            await send_json(send, 405, {"error": {"message": "use GET"}})
        elif path in ("/health", "/health_generate"):
            await send_json(send, 200, {})
        elif path in ("/model_info", "/get_model_info", "/server_info", "/get_server_info"):
            await send_json(send, 200, self._info(scope))
        elif path == "/stats":
            await send_json(send, 200, {"requests": self.requests})
        else:
            await send_json(send, 404, {"error": {"message": f"no route {path}"}})

    async def _generate(self, raw: bytes, send) -> None:
        try:
            body = orjson.loads(raw)
            samples = parallel_samples(body)
            answers = [
                stub_answer(body, self.output_tokens, self.token_id, self.latency_s, self.ruled, self.routing)
                for _ in range(samples)
            ]
        except (orjson.JSONDecodeError, ValueError) as exc:
            await send_json(send, 400, {"error": {"message": str(exc)}})
            return
        started = time.perf_counter()
        if self.latency_s > 0:
            await asyncio.sleep(self.latency_s)
        for answer in answers:
            answer["meta_info"]["e2e_latency"] = time.perf_counter() - started
        self.requests += 1
        # SGLang answers a group (n > 1) with the list of its samples in order
        # (TokenizerManager._collect_batch_responses), a single request with one object.
        await send_json(send, 200, answers if samples > 1 else answers[0])


def create_app(
    latency_s: float,
    output_tokens: int,
    token_id: int = 42,
    ruled: RuledReplies | None = None,
    routing: tuple[int, int, int] | None = None,
) -> UpstreamStub:
    return UpstreamStub(latency_s, output_tokens, token_id, ruled, routing)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="rolloutfleet-upstream-stub",
        description="Fixed-latency stand-in for an SGLang server's /generate (benchmarks, tests).",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--latency-s", type=float, default=0.1)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--token-id", type=int, default=42)
    parser.add_argument(
        "--routed-experts",
        metavar="LAYERSxTOP_KxEXPERTS",
        help="answer return_routed_experts with rows of this shape (e.g. 48x8x128)",
    )
    args = parser.parse_args(argv)
    routing = tuple(int(v) for v in args.routed_experts.split("x")) if args.routed_experts else None

    import uvicorn

    # uvloop and httptools keep the stub's own overhead small; no access log for the same reason.
    uvicorn.run(
        create_app(args.latency_s, args.output_tokens, args.token_id, routing=routing),  # type: ignore[arg-type]
        host=args.host,
        port=args.port,
        loop="uvloop",
        http="httptools",
        access_log=False,
        log_level="warning",
    )


if __name__ == "__main__":
    main()


def stand_in_args(sglang_args: Sequence[str]) -> list[str]:
    """SGLang launch_server arguments → the stand-in's: where to listen; the rest (model path,
    parallelism, memory) means nothing to it (pure)."""
    flags = launch_flags(sglang_args)
    return [word for flag in ("--host", "--port") if flags.get(flag) for word in (flag, str(flags[flag]))]


def sglang_main() -> None:
    """`python -m sglang.launch_server ARGS` in an engine pod running the test kit's image (its
    `sglang` shim, images/testkit): this stand-in in place of SGLang, for clusters short of the disk
    the SGLang emulator's torch image takes."""
    import sys

    main(stand_in_args(sys.argv[1:]))
