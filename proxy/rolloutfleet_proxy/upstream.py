"""The SGLang upstream: /generate with input ids, answers parsed into typed arrays."""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np
import orjson

from .failures import ContextLengthExceeded, Failure, SamplingRefused, UpstreamFailed, UpstreamTimedOut
from .storage.images import ImageStore

# sglang-router's `manual` policy routes requests with the same key to the same engine.
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
# Answers from this size on are parsed in a worker thread: with routing replay, a long prompt's first
# answer carries its rows (a 32k-token prompt of a 48 x 8 model: 67 MB of base64).
OFFLOAD_PARSE_BYTES = 1 << 20


@dataclass(frozen=True)
class Generation:
    output_ids: array  # int32
    logprobs: array  # float32, one per output id
    text: str
    finish_reason: str  # "stop" | "length" | other SGLang finish types
    stop_token: int | None  # the generated id that ended the reply, when it is the last output id
    prompt_tokens: int
    stop_string: str | None = None  # the stop string that ended the reply (its tokens stay in output_ids)
    weight_version: str | None = None  # SGLang's meta_info.weight_version: the weights that answered
    cached_tokens: int = 0  # prompt tokens the engine's prefix cache already held
    abort_message: str | None = None  # set when finish_reason is "abort": the engine stopped early
    rid: str | None = None  # SGLang's meta_info.id: the engine request (a sample's own rid, in a group)
    # The prompt ids as the engine expanded them (`return_prompt_token_ids`, asked with images).
    prompt_token_ids: array | None = None
    # Routing replay: `meta_info.routed_experts` as SGLang sent it (base64 of int32 rows), when asked.
    routed_experts: str | None = None

    @property
    def aborted(self) -> bool:
        """SGLang aborted the request (a pause in abort mode, a weight update, /abort_request): the
        answer is HTTP 200 and output_ids hold the tokens made before the abort."""
        return self.finish_reason == "abort"


def sglang_error_message(body: bytes) -> str:
    """The message of an SGLang error answer (`{"error": {"message": ...}}`, or `{"message": ...}`
    as older releases and the router write it), else the body's first 300 characters."""
    try:
        answer = orjson.loads(body)
    except orjson.JSONDecodeError:
        answer = None
    if isinstance(answer, dict):
        inner = answer.get("error")
        message = inner.get("message") if isinstance(inner, dict) else answer.get("message")
        if isinstance(message, str) and message:
            return message[:1000]
    return body[:300].decode(errors="replace")


def refused_request(message: str) -> Failure:
    """SGLang answers 400 for requests it will not run (`TokenizerManager._validate_one_request`,
    `SamplingParams.verify`): the client's problem, not a retryable upstream failure."""
    if "context length" in message.lower():
        return ContextLengthExceeded(message)
    return SamplingRefused(message)


def _loads(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise UpstreamFailed(f"upstream answered with invalid JSON: {exc}") from None


def parse_generate_answer(body: bytes) -> Generation:
    """Validate an SGLang /generate answer; anything inconsistent is an upstream error (502)."""
    answer = _loads(body)
    if isinstance(answer, list) and len(answer) == 1:
        answer = answer[0]
    return _generation(answer)


def parse_generate_samples(body: bytes, n: int) -> list[Generation]:
    """The answer to a /generate with `sampling_params.n`: for n > 1 SGLang answers a JSON list of the
    n samples' results in sample order (`TokenizerManager._handle_batch_request`), for n = 1 one result.
    Any other count is an upstream error (502): an engine that ignored n."""
    answer = _loads(body)
    results = answer if isinstance(answer, list) else [answer]
    if len(results) != n:
        raise UpstreamFailed(f"upstream answered {len(results)} results for n={n} samples")
    return [_generation(result) for result in results]


def _generation(answer: object) -> Generation:
    if not isinstance(answer, dict) or not isinstance(answer.get("meta_info"), dict):
        raise UpstreamFailed("upstream answer has no meta_info object")
    meta: dict[str, Any] = answer["meta_info"]
    finish = meta.get("finish_reason") or {}
    finish_type = finish.get("type", "stop") if isinstance(finish, dict) else str(finish)
    token_logprobs = meta.get("output_token_logprobs")
    if token_logprobs is None and finish_type == "abort" and not answer.get("output_ids"):
        token_logprobs = []  # aborted before its first token (e.g. while queued)
    if not isinstance(token_logprobs, list):
        raise UpstreamFailed("upstream answer has no output_token_logprobs (was return_logprob honoured?)")
    try:
        logprobs = array("f", [float(entry[0]) for entry in token_logprobs])
        logprob_ids = [int(entry[1]) for entry in token_logprobs]
    except (TypeError, ValueError, IndexError):
        raise UpstreamFailed(
            "upstream output_token_logprobs entries are not [logprob, token_id, ...]"
        ) from None
    output_ids = answer.get("output_ids", logprob_ids)
    if output_ids != logprob_ids:
        raise UpstreamFailed("upstream output_ids disagree with the ids in output_token_logprobs")
    matched = finish.get("matched") if isinstance(finish, dict) else None
    stop_token = matched if isinstance(matched, int) and output_ids and output_ids[-1] == matched else None
    abort_message = None
    if finish_type == "abort":
        message = finish.get("message") if isinstance(finish, dict) else None
        abort_message = str(message) if message else "no reason given"
    weight_version = meta.get("weight_version")
    rid = meta.get("id")
    text = answer.get("text", "")
    if not isinstance(text, str):
        raise UpstreamFailed("upstream text is not a string")
    routed = meta.get("routed_experts")
    prompt_ids = answer.get("prompt_token_ids")
    if prompt_ids is not None:
        try:
            prompt_ids = array("i", prompt_ids)
        except (TypeError, OverflowError):
            raise UpstreamFailed("upstream prompt_token_ids are not token ids") from None
    return Generation(
        output_ids=array("i", output_ids),
        logprobs=logprobs,
        text=text,
        finish_reason=finish_type,
        stop_token=stop_token,
        prompt_tokens=int(meta.get("prompt_tokens", 0) or 0),
        stop_string=matched if isinstance(matched, str) else None,
        weight_version=None if weight_version is None else str(weight_version),
        cached_tokens=_count(meta.get("cached_tokens")),
        abort_message=abort_message,
        rid=rid if isinstance(rid, str) else None,
        prompt_token_ids=prompt_ids,
        routed_experts=routed if isinstance(routed, str) else None,
    )


def _data_uri_head(media_type: str) -> bytes:
    return b'"data:' + media_type.encode() + b";base64,"


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


class SGLangClient:
    """aiohttp, not httpx: under a few hundred concurrent turns httpcore's pool scanned every
    connection on each request and the proxy spent ~79% of its CPU there (py-spy, bench/overhead.py)."""

    def __init__(
        self, base_url: str, timeout_s: float, max_connections: int, images: ImageStore | None = None
    ):
        self._url = base_url.rstrip("/") + "/generate"
        self._images = images
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=min(10.0, timeout_s))
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        # Created lazily inside the running loop that will use it.
        if self._session is None:
            connector = aiohttp.TCPConnector(
                limit=self._max_connections, limit_per_host=0, keepalive_timeout=30
            )
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any],
        routing_key: str | None = None,
        rid: str | None = None,
        images: Sequence[bytes] = (),
        routed_experts_start: int | None = None,
    ) -> Generation:
        """One `/generate`. `routing_key` (the session id) goes in `X-SMG-Routing-Key`, the header
        sglang-router's `manual` policy routes by, so a session's turns stay on one engine's prefix
        cache. `rid` names the request on the engine (its logs, `/abort_request`). `images`: the
        digests of every image of the prompt, in order (one placeholder each in `input_ids`).
        `routed_experts_start`: ask for the routing of positions from there on (routing replay)."""
        body = await self._post_generate(
            input_ids, sampling_params, routing_key, rid, images, routed_experts_start
        )
        if len(body) >= OFFLOAD_PARSE_BYTES:
            return await asyncio.to_thread(parse_generate_answer, body)
        return parse_generate_answer(body)

    async def generate_samples(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any],
        n: int,
        routing_key: str | None = None,
        rid: str | None = None,
        images: Sequence[bytes] = (),
        routed_experts_start: int | None = None,
    ) -> list[Generation]:
        """n samples of one prompt in ONE `/generate` with `sampling_params.n` (a GRPO group), in
        SGLang's sample order. SGLang batches them itself (`TokenizerManager._handle_batch_request`):
        it prefills the prompt once into its prefix cache, then runs the n samples as independent
        requests (each its own random stream, finish reason, logprobs and `Generation.rid`).
        sglang-router 0.3.2 passes `n` through and returns the engine's list unchanged, so this works
        through the router as straight to an engine. SGLang names each sample anew: `rid` reaches the
        engine but names no sample, so `/abort_request` by it aborts nothing; a pause in abort mode (or
        `abort_all`) aborts every sample, each answered with its own tokens so far. The samples share
        the sampling parameters: under `--enable-deterministic-inference` a `sampling_seed` makes all n
        the same sequence."""
        if n < 1:
            raise ValueError(f"n must be at least 1, got {n}")
        params = {key: value for key, value in sampling_params.items() if key != "n"}
        if n > 1:
            params["n"] = n
        body = await self._post_generate(input_ids, params, routing_key, rid, images, routed_experts_start)
        if len(body) >= OFFLOAD_PARSE_BYTES:
            return await asyncio.to_thread(parse_generate_samples, body, n)
        return parse_generate_samples(body, n)

    async def _post_generate(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any],
        routing_key: str | None,
        rid: str | None,
        images: Sequence[bytes] = (),
        routed_experts_start: int | None = None,
    ) -> bytes:
        """POST /generate (non-streaming, output logprobs); the body of a 200, else the upstream's failure.
        With images, `image_data` lists each as a data URI, streamed from the image store (one piece of
        one image in memory at a time), and the engine answers the prompt ids it expanded."""
        request: dict[str, Any] = {
            # An int32 array goes out through numpy: no Python int per token for long prompts.
            "input_ids": np.frombuffer(input_ids, dtype=np.int32)
            if isinstance(input_ids, array)
            else input_ids,
            "sampling_params": sampling_params,
            "return_logprob": True,
            "logprob_start_len": -1,  # logprobs of output tokens only
            "stream": False,
        }
        if rid is not None:
            request["rid"] = rid
        if images:
            request["return_prompt_token_ids"] = True
        if routed_experts_start is not None:
            # Needs engines run with --enable-return-routed-experts, and a gateway that passes these
            # fields (sglang-router 0.3.2 drops them: its GenerateRequest has no catch-all).
            request["return_routed_experts"] = True
            request["routed_experts_start_len"] = routed_experts_start
        payload = orjson.dumps(request, option=orjson.OPT_SERIALIZE_NUMPY)
        headers = {"content-type": "application/json"}
        if routing_key is not None:
            headers[ROUTING_KEY_HEADER] = routing_key
        data: Any = payload
        if images:
            data, length = self._with_images(payload, images)
            headers["content-length"] = str(length)
        try:
            async with self._client().post(self._url, data=data, headers=headers) as response:
                body = await response.read()
                status = response.status
        except TimeoutError:
            raise UpstreamTimedOut("upstream /generate timed out") from None
        except aiohttp.ClientError as exc:
            raise UpstreamFailed(f"upstream unreachable: {type(exc).__name__}: {exc}") from None
        if status == 400:
            raise refused_request(sglang_error_message(body))
        if status != 200:
            snippet = body[:300].decode(errors="replace")
            raise UpstreamFailed(f"upstream /generate answered {status}: {snippet}")
        return body

    def _with_images(self, payload: bytes, images: Sequence[bytes]) -> tuple[Any, int]:
        """The request body with `image_data` appended, as an async iterable, and its length."""
        store = self._images
        if store is None:
            raise UpstreamFailed("this proxy has no image store")
        infos = [store.info(digest) for digest in images]
        head = payload[:-1] + b',"image_data":['
        length = len(head) + len(b"]}") + len(infos) - 1
        for info in infos:
            length += len(_data_uri_head(info.media_type)) + 4 * ((info.size + 2) // 3) + 1

        async def body():
            yield head
            for index, info in enumerate(infos):
                yield (b"," if index else b"") + _data_uri_head(info.media_type)
                async for piece in store.base64_chunks(info.digest):
                    yield piece
                yield b'"'
            yield b"]}"

        return body(), length
