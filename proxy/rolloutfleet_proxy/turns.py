"""One chat turn in a session: tokenize what is new, ask the upstream, record, then answer.

The session lock is held for the whole turn, so a reply is only ever returned after it was
recorded. A concurrent turn is refused (409) rather than queued; a DELETE cancels the upstream
call and the turn answers 410; an upstream failure leaves the session exactly as it was. While
generation is paused a turn waits at the gate before its upstream call, and the turn is recorded
under the model version current when it passed the gate.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass

from .chat_tokens import TemplateError, TurnTokenizer
from .continuation import (
    MAX_CONTINUATIONS,
    MergedTurn,
    Segment,
    continuation_request,
    engine_version,
    logprobs_tempered,
    merge_segments,
)
from .errors import ProxyError
from .failures import (
    Failure,
    HistoryMismatch,
    NewMessagesTooLarge,
    NoNewMessages,
    PauseOutlasted,
    SessionDeleted,
    SessionEnded,
    SessionFinished,
    ShuttingDown,
    TemplateFailed,
    TurnInFlight,
    UpstreamAborted,
)
from .generation import GenerationControl
from .history import extend_canonical_digest, extend_digest, tools_digest
from .lifecycle import InFlightTurns
from .openai_format import ChatRequest
from .replies import Reply, ReplyBuilder
from .session import Session, TurnFields
from .session_log import SessionLog
from .stats import Counters
from .store import SessionStore
from .upstream import Generation, SGLangClient


@dataclass(frozen=True)
class TurnLimits:
    max_new_message_bytes: int = 512 * 1024
    offload_templating_bytes: int = 32 * 1024


def message_text_bytes(messages: list[dict], stop_after: int | None = None) -> int:
    """Characters of text in canonical messages (content, reasoning, tool-call arguments and names):
    what templating and tokenizing cost grows with. Stops counting past `stop_after` when given."""
    total = 0
    for message in messages:
        for key in ("content", "reasoning_content", "name"):
            value = message.get(key)
            if isinstance(value, str):
                total += len(value)
        for call in message.get("tool_calls") or ():
            total += len(str(call))
        if stop_after is not None and total > stop_after:
            break
    return total


@dataclass(frozen=True)
class TurnResult:
    turn_index: int
    generation: Generation
    prompt_tokens: int
    reply: Reply


def _ms(start: float, end: float) -> float:
    return round((end - start) * 1000, 3)


class TurnService:
    def __init__(
        self,
        store: SessionStore,
        tokenizer: TurnTokenizer,
        upstream: SGLangClient,
        counters: Counters,
        in_flight: InFlightTurns,
        generation: GenerationControl,
        replies: ReplyBuilder,
        engine_logprobs: str = "tempered",
        session_log: SessionLog | None = None,
        limits: TurnLimits | None = None,
        after_large_turn: Callable[[], None] | None = None,
    ):
        self._limits = limits or TurnLimits()
        self._after_large_turn = after_large_turn
        self._engine_logprobs = engine_logprobs
        self._log = session_log
        self._generation = generation
        self._replies = replies
        self._store = store
        self._tokenizer = tokenizer
        self._upstream = upstream
        self._counters = counters
        # Every turn counts from its start to its journal commit (the drain waits for them: a session
        # whose turn is still committing would be skipped by the drain).
        self._in_flight = in_flight

    def new_input_ids(self, session: Session, request: ChatRequest) -> tuple[array, str, bytes]:
        """Ids to append for this request's new messages, their rendered text, and the history digest
        after them. The session's tools are part of its first prompt: they seed the digest."""
        messages = request.messages
        recorded = session.message_count
        if len(messages) <= recorded:
            raise NoNewMessages(recorded)
        seed = tools_digest(request.tools.tools if request.tools else None)
        if recorded and extend_canonical_digest(seed, messages[:recorded]) != session.history_digest:
            raise HistoryMismatch(recorded)
        new = messages[recorded:]
        tools = request.tools.rendered if request.tools else None
        try:
            if session.num_turns == 0:
                ids, text = self._tokenizer.first_turn(new, tools, request.template_kwargs)
            else:
                ids, text = self._tokenizer.continuation(
                    new, session.last_stop_token, tools, request.template_kwargs
                )
        except TemplateError as exc:
            raise TemplateFailed(str(exc)) from None
        except Exception as exc:  # jinja raise_exception and friends: the messages do not fit the template
            raise TemplateFailed(f"chat template failed on these messages: {exc}") from None
        return ids, text, extend_canonical_digest(session.history_digest if recorded else seed, new)

    async def _new_input(self, session: Session, request: ChatRequest) -> tuple[array, str, bytes]:
        """`new_input_ids`, in a worker thread when the messages are large: templating and tokenizing
        megabytes takes seconds, and the loop serves every other session meanwhile (HF tokenizers
        release the GIL while encoding). The session lock is held: nothing else reads or changes it."""
        new_text = message_text_bytes(request.messages[session.message_count :])
        if new_text > self._limits.max_new_message_bytes:
            raise NewMessagesTooLarge(new_text, self._limits.max_new_message_bytes)
        offload_from = self._limits.offload_templating_bytes
        if message_text_bytes(request.messages, stop_after=offload_from) < offload_from:
            return self.new_input_ids(session, request)  # the common turn: a thread hop costs more
        self._counters.turns_templated_off_loop += 1
        try:
            return await asyncio.to_thread(self.new_input_ids, session, request)
        finally:
            if self._after_large_turn is not None:
                self._after_large_turn()  # the tokenizer's native buffers were freed: give them back

    async def run_turn(self, session: Session, request: ChatRequest, timings: dict[str, float]) -> TurnResult:
        if self._in_flight.closed:
            raise ShuttingDown("the proxy is shutting down; retry on its replacement")
        if session.finished:
            raise SessionFinished(session.session_id)
        if session.busy:
            self._counters.turns_busy_rejected += 1
            raise TurnInFlight(session.session_id)
        if self._log is not None:
            self._log.require_writable("this turn was not run")
        t_lock = time.perf_counter()
        with self._in_flight.turn():
            return await self._locked_turn(session, request, timings, t_lock)

    async def _locked_turn(
        self, session: Session, request: ChatRequest, timings: dict[str, float], t_lock: float
    ) -> TurnResult:
        async with session.lock:  # uncontended: acquired without yielding
            t_tok = time.perf_counter()
            timings["lock_wait_ms"] = _ms(t_lock, t_tok)
            if session.closed:
                raise SessionEnded(session.session_id, session.close_reason)
            session.touch()
            new_ids, prompt_tail, digest = await self._new_input(session, request)
            prompt = array("i", session.token_ids)  # a copy (memcpy): no Python int per token
            prompt.extend(new_ids)
            t_up = time.perf_counter()
            timings["tokenize_ms"] = _ms(t_tok, t_up)
            turn, paused_s = await self._call_upstream(session, prompt, request.sampling_params)
            generation = turn.generation
            t_rec = time.perf_counter()
            if paused_s > 0:
                timings["pause_wait_ms"] = round(paused_s * 1000, 3)
            timings["upstream_ms"] = round(_ms(t_up, t_rec) - paused_s * 1000, 3)
            stop_token = self._tokenizer.stop_token(generation.output_ids, generation.stop_token)
            reply = self._replies.build(generation, stop_token, request.tools, prompt_tail)
            temperature, tempered = logprobs_tempered(self._engine_logprobs, request.sampling_params)
            fields = TurnFields(
                message_count=len(request.messages) + 1,
                history_digest=extend_digest(digest, [reply.message()]),
                stopped=stop_token is not None,
                stop_token=stop_token,
                model_version=turn.version,
                version_changes=turn.version_changes,
                temperature=temperature,
                tempered=tempered,
            )
            mark = session.mark()
            added = session.append_turn(new_ids, generation.output_ids, generation.logprobs, **fields)
            self._store.record_growth(added)
            turn_index = session.num_turns - 1
            pending = None
            try:
                if self._log is not None:  # same synchronous step as the append: journal order = change order
                    pending = self._log.turn(
                        session, turn_index, new_ids, generation.output_ids, generation.logprobs, **fields
                    )
                    t_journal = time.perf_counter()
                    await self._log.commit(pending)
                    timings["journal_ms"] = _ms(t_journal, time.perf_counter())
            except Failure:
                # Not durable, so not delivered: the session is as it was, the client may retry the turn.
                removed = session.rollback(mark)
                if not session.closed:
                    self._store.record_growth(-removed)
                self._counters.turns_failed += 1
                raise
            session.touch()
            self._counters.turns += 1
            timings["record_ms"] = _ms(t_rec, time.perf_counter())
            return TurnResult(turn_index, generation, len(prompt), reply)

    async def _generate(self, prompt: array, sampling: dict, session: Session) -> tuple[MergedTurn, float]:
        """Pass the pause gate, then generate; an aborted generation passes the gate again (so it waits
        for the resume) and continues with its tokens kept. Returns the turn and the seconds held by
        pauses."""
        segments: list[Segment] = []
        paused_total = 0.0
        request: tuple[array, dict] | None = (prompt, sampling)
        rid = f"{session.session_id}-{session.num_turns}-{secrets.token_hex(4)}"
        try:
            while request is not None:
                proxy_version, paused_s = await self._generation.enter()
                paused_total += paused_s
                try:
                    generation = await self._upstream.generate(
                        request[0], request[1], session.session_id, f"{rid}-{len(segments)}"
                    )
                finally:
                    self._generation.leave()
                segments.append(Segment(generation, engine_version(generation.weight_version, proxy_version)))
                if not generation.aborted:
                    break
                if len(segments) > MAX_CONTINUATIONS:
                    raise UpstreamAborted(len(segments), generation.abort_message)
                request = continuation_request(prompt, sampling, segments)
                if request is not None:
                    self._counters.turns_continued += 1
        except BaseException:
            # Tokens an engine made before an abort that could not be continued: counted, not hidden.
            self._counters.generated_tokens_discarded += sum(len(s.generation.output_ids) for s in segments)
            raise
        turn = merge_segments(segments, int(sampling["max_new_tokens"]), self._tokenizer.decode)
        self._counters.generated_tokens_continued += sum(len(s.generation.output_ids) for s in segments[:-1])
        return turn, paused_total

    async def _call_upstream(
        self, session: Session, prompt: array, sampling: dict
    ) -> tuple[MergedTurn, float]:
        # One task for the wait at the gate and the call: a DELETE or the drain cancels either.
        task = asyncio.create_task(self._generate(prompt, sampling, session))
        try:
            with self._in_flight.generation(session, task):
                await asyncio.wait({task})
        finally:
            if not task.done():
                task.cancel()  # our own request was cancelled (client gone, shutdown): nothing is recorded
        if task.cancelled() or session.closed:
            self._counters.turns_cancelled += 1
            if not session.closed:  # only the shutdown drain cancels a turn of a session it keeps
                raise ShuttingDown("the proxy shut down during this turn; nothing was recorded")
            raise SessionDeleted(session.session_id)
        try:
            return task.result()
        except PauseOutlasted:
            self._counters.turns_pause_timeouts += 1
            raise
        except ShuttingDown:  # the gate closed for shutdown while the turn waited
            self._counters.turns_cancelled += 1
            raise
        except (ProxyError, Failure):  # upstream errors, aborts
            self._counters.turns_failed += 1
            raise
