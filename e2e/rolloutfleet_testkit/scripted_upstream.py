"""Scripted upstream: a TEST STAND-IN for an SGLang server's `/generate` that answers with replies a
test wrote in a model family's real output format (reasoning, tool calls, stop tokens), because no
model here produces them by itself.

Each `/generate` takes the next scripted reply (output ids) and answers in SGLang's shape, as
`TokenizerManager` builds it: `text` decoded without special tokens, `output_ids`, and `meta_info`
with `finish_reason` `{"type": "stop", "matched": <id>}` when the reply ends on one of the stop ids
(SGLang reports the matched EOS id), else `{"type": "length", "length": n}`, and
`output_token_logprobs` as `[logprob, id, None]` triples. It keeps every request's `input_ids`, so a
test can compare what the proxy sent with its own reference.
"""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Callable, Collection, Sequence

import orjson

from .asgi import lifespan, read_body, send_json


def reply_logprobs(count: int) -> list[float]:
    """Distinct, checkable logprobs for a reply of `count` tokens."""
    return [-0.01 * (i + 1) for i in range(count)]


class ScriptedUpstream:
    """The ASGI app. `script(ids)` queues replies; `prompts` holds the input ids of every request."""

    def __init__(self, decode: Callable[[list[int]], str], stop_ids: Collection[int]):
        self._decode = decode
        self._stop_ids = frozenset(stop_ids)
        self._replies: deque[list[int]] = deque()
        self.prompts: list[list[int]] = []

    def script(self, *replies: Sequence[int]) -> None:
        self._replies.extend(list(r) for r in replies)

    def answer(self, body: dict) -> tuple[int, dict]:
        input_ids = body.get("input_ids")
        if not isinstance(input_ids, list) or not self._replies:
            return 400, {"error": {"message": "no input_ids, or no scripted reply left"}}
        self.prompts.append(input_ids)
        output_ids = self._replies.popleft()
        if output_ids and output_ids[-1] in self._stop_ids:
            finish = {"type": "stop", "matched": output_ids[-1]}
        else:
            finish = {"type": "length", "length": len(output_ids)}
        meta = {
            "id": uuid.uuid4().hex,
            "finish_reason": finish,
            "prompt_tokens": len(input_ids),
            "completion_tokens": len(output_ids),
            "cached_tokens": 0,
            "e2e_latency": 0.0,
        }
        if body.get("return_logprob"):
            logprobs = reply_logprobs(len(output_ids))
            pairs = zip(logprobs, output_ids, strict=True)
            meta["output_token_logprobs"] = [[logprob, i, None] for logprob, i in pairs]
        return 200, {"text": self._decode(output_ids), "output_ids": output_ids, "meta_info": meta}

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path in ("/health", "/health_generate"):
            await send_json(send, 200, {})
            return
        if path != "/generate" or scope["method"] != "POST":
            await send_json(send, 404, {"error": {"message": f"no route {path}"}})
            return
        try:
            body = orjson.loads(await read_body(receive))
        except orjson.JSONDecodeError:
            await send_json(send, 400, {"error": {"message": "invalid JSON"}})
            return
        status, payload = self.answer(body if isinstance(body, dict) else {})
        await send_json(send, status, payload)
