"""Scripted upstream: a TEST STAND-IN for an SGLang server's `/generate` that answers with replies a
test wrote in a model family's real output format (reasoning, tool calls, stop tokens), because no
model here produces them by itself.

It is the upstream stub (`upstream_stub`, SGLang's answer shape) with a rule that takes the next
scripted reply: `text` decoded as SGLang decodes it (without special tokens), `finish_reason`
`{"type": "stop", "matched": <id>}` when the reply ends on a stop id, and distinct logprobs
(`reply_logprobs`). It keeps every request's `input_ids`, so a test can compare what the proxy sent
with its own reference.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Sequence

from .upstream_stub import RuledReplies, UpstreamStub, reply_logprobs

__all__ = ["ScriptedUpstream", "reply_logprobs"]


class ScriptedUpstream(UpstreamStub):
    """The ASGI app. `script(ids, ...)` queues replies; `prompts` holds every request's input ids.
    With no reply queued, a request gets an empty reply."""

    def __init__(self, decode: Callable[[list[int]], str], stop_ids: Collection[int]):
        self._replies: deque[list[int]] = deque()
        self.prompts: list[list[int]] = []
        super().__init__(0.0, 0, ruled=RuledReplies(self._next_reply, frozenset(stop_ids), decode))

    def script(self, *replies: Sequence[int]) -> None:
        self._replies.extend(list(r) for r in replies)

    def _next_reply(self, input_ids: list[int]) -> list[int] | None:
        self.prompts.append(input_ids)
        return self._replies.popleft() if self._replies else None
