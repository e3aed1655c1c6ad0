"""One chat turn in a session: tokenize what is new, ask the upstream, record, then answer.

The session lock is held for the whole turn, so a reply is only ever returned after it was
recorded. A concurrent turn is refused (409) rather than queued; a DELETE cancels the upstream
call and the turn answers 410; an upstream failure leaves the session exactly as it was. While
generation is paused a turn waits at the gate before its upstream call, and the turn is recorded
under the model version current when it passed the gate.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import itertools
import random
import secrets
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, replace

from rolloutfleet_wire import session_tree as tree
from rolloutfleet_wire.routed_experts import RoutingError, first_row
from rolloutfleet_wire.session_record import (
    FINISH_CODES,
    FINISH_NAMES,
    FINISH_UNKNOWN,
    FLAG_PROMPT_OPENS_REASONING,
    NO_DIGEST,
    NO_STOP_TOKEN,
    ROOT,
    ImageSpan,
)

from .branching import Placement, attach, message_digests, place
from .chat_tokens import TemplateError, TurnTokenizer
from .continuation import (
    MergedTurn,
    Segment,
    abort_backoff_s,
    continuation_request,
    engine_version,
    logprobs_tempered,
    merge_segments,
    restarts_after_abort,
)
from .failures import (
    ClientGone,
    Failure,
    IdempotencyKeyReused,
    NewMessagesTooLarge,
    NoNewMessages,
    PauseOutlasted,
    SessionDeleted,
    SessionEnded,
    SessionFinished,
    ShuttingDown,
    TemplateFailed,
    ToolResultWithoutCall,
    TooManyBranches,
    TurnInFlight,
    UnknownPreviousTurn,
    UpstreamAborted,
    UpstreamImageMismatch,
    UpstreamRoutingMissing,
)
from .generation import GenerationControl
from .history import extend_digest, image_parts, message_text, tools_digest
from .image_intake import ImageIntake
from .image_tokens import collapse, expand, expansion_problem, placeholder_offsets
from .images import ImageLimits
from .lifecycle import CancelCause, InFlightTurns
from .openai_format import ChatRequest
from .reasoning_parsers import ReasoningParser
from .replies import Reply, ReplyBuilder, prompt_opens_reasoning
from .routing_rows import next_start, turn_rows
from .session import RecordedTurn, Session
from .stats import Counters
from .storage import Pending, Storage
from .storage.images import ImageStore
from .storage.routing_store import routing_key
from .store import SessionStore
from .tool_grammar import OFFLOAD_TOOLS, tool_choice_grammar
from .upstream import Generation, SGLangClient


@dataclass(frozen=True)
class TurnLimits:
    max_new_message_bytes: int = 512 * 1024
    offload_templating_bytes: int = 32 * 1024
    max_branches: int = 256  # leaves per session
    abort_ride_through_s: float = 600.0  # how long aborts without progress are resubmitted
    # Routing replay payloads (base64) from which decoding them runs in a worker thread.
    offload_routing_bytes: int = 1 << 20


def message_text_bytes(messages: list[dict], stop_after: int | None = None) -> int:
    """Characters of text in canonical messages (content, reasoning, tool-call arguments and names):
    what templating and tokenizing cost grows with. Stops counting past `stop_after` when given."""
    total = 0
    for message in messages:
        for key in ("content", "reasoning_content", "name"):
            value = message.get(key)
            if isinstance(value, str):
                total += len(value)
            elif key == "content" and value:  # parts: their text (images are bounded apart)
                total += len(message_text(value))
        for call in message.get("tool_calls") or ():
            total += len(str(call))
        if stop_after is not None and total > stop_after:
            break
    return total


@dataclass(frozen=True)
class Choice:
    """One recorded answer of a call: its turn, the reply the client gets, and the ids behind it."""

    turn: int
    reply: Reply
    finish: str  # SGLang's finish type: "stop", "length", "abort"
    output_ids: array
    logprobs: array
    stop_string: str | None = None  # the stop string that ended it, if one did


@dataclass(frozen=True)
class TurnResult:
    call: int  # the first turn the request recorded
    choices: list[Choice]
    prompt_tokens: int
    created: float
    replayed: bool = False  # answered from the record, without the engine


@dataclass(frozen=True)
class NewInput:
    """What a request adds to its session's tree, before the engine answers."""

    placement: Placement
    ids: array  # the prompt ids after the base's reply (the whole prompt at the root), images expanded
    text: str  # their rendered text
    parent: int
    keep: int
    own_ids: array  # the part of `ids` not already stored under `parent`
    history_length: int  # messages in the whole history before the reply
    images: tuple[ImageSpan, ...] = ()  # the new messages' images, offsets into `ids`
    own_images: tuple[ImageSpan, ...] = ()  # those among `own_ids`, offsets into `own_ids`


@dataclass(frozen=True)
class EnginePrompt:
    """A turn's prompt as the engine gets it and as it is recorded. Without images both are the same
    ids; with images the engine gets one placeholder per image and every image of the prompt in order,
    and must answer that it expanded them to `expanded` (what is recorded)."""

    ids: array
    expanded: array
    images: list[ImageSpan]  # offsets into `expanded`
    recorded_images: int  # the first ones, recorded on earlier turns

    @property
    def digests(self) -> list[bytes]:
        return [image.digest for image in self.images]


def _ms(start: float, end: float) -> float:
    return round((end - start) * 1000, 3)


def call_parameters(request: ChatRequest) -> dict:
    """The parameters that make two requests with the same history the same request."""
    parameters = {
        "sampling": request.sampling_params,
        "n": request.n,
        "tools": request.tools.tools if request.tools else None,
        "tool_choice": request.tools.choice if request.tools else None,
        "template": request.template_kwargs,
    }
    if request.tools and not request.tools.parallel:  # only then: the digests of other requests stay
        parameters["parallel_tool_calls"] = False
    return parameters


def idempotency_key_digest(key: str) -> str:
    return hashlib.blake2b(key.encode(), digest_size=16).hexdigest()


class TurnService:
    def __init__(
        self,
        store: SessionStore,
        storage: Storage,
        tokenizer: TurnTokenizer,
        upstream: SGLangClient,
        counters: Counters,
        in_flight: InFlightTurns,
        generation: GenerationControl,
        replies: ReplyBuilder,
        engine_logprobs: str = "tempered",
        limits: TurnLimits | None = None,
        after_large_turn: Callable[[], None] | None = None,
        intake: ImageIntake | None = None,
    ):
        self._limits = limits or TurnLimits()
        # Without one (text-only tests): images are refused, as for a model directory without images.
        self._intake = intake or ImageIntake(ImageStore(None), ImageLimits(), None, counters)
        self._vision = self._intake.vision
        self._image_store = self._intake.store
        self._after_large_turn = after_large_turn
        self._engine_logprobs = engine_logprobs
        self._storage = storage
        self._generation = generation
        self._replies = replies
        self._store = store
        self._tokenizer = tokenizer
        self._upstream = upstream
        self._counters = counters
        # Every turn counts from its start to its journal commit (the drain waits for them: a session
        # whose turn is still committing would be skipped by the drain).
        self._in_flight = in_flight

    def plan(self, session: Session, request: ChatRequest) -> NewInput | TurnResult:
        """A recorded answer to send again (a retry), or the ids this request adds to the tree."""
        if request.previous is None:
            seed = tools_digest(request.tools.tools if request.tools else None)
            placement = place(session, message_digests(seed, request.messages), call_parameters(request))
            history_length = len(request.messages)
        else:  # the history is the named turn's: its digest goes on with the messages after it
            previous = self._previous_turn(session, request)
            digests = message_digests(tree.digest_at(session.turn_end_digests, previous), request.messages)
            placement = place(session, digests, call_parameters(request), base=previous)
            history_length = session.turn_message_counts[previous] + len(request.messages)
        replay = self._replay(session, request, placement.request_digest)
        if replay is not None:
            return replay
        if placement.matched == len(request.messages):
            raise NoNewMessages(placement.matched)
        new = request.messages[placement.matched :]
        new_text = message_text_bytes(new)
        if new_text > self._limits.max_new_message_bytes:
            raise NewMessagesTooLarge(new_text, self._limits.max_new_message_bytes)
        tools = request.tools.rendered if request.tools else None
        try:
            if placement.base == ROOT:
                ids, text = self._tokenizer.first_turn(new, tools, request.template_kwargs)
            else:
                stop_token = session.turn_stop_tokens[placement.base]
                ids, text = self._tokenizer.continuation(
                    new,
                    None if stop_token == NO_STOP_TOKEN else stop_token,
                    tools,
                    request.template_kwargs,
                    reply=request.messages[placement.matched - 1],  # the base's reply, as the client has it
                )
        except TemplateError as exc:
            raise TemplateFailed(str(exc)) from None
        except Exception as exc:  # jinja raise_exception and friends: the messages do not fit the template
            raise TemplateFailed(f"chat template failed on these messages: {exc}") from None
        images: list[ImageSpan] = []
        if self._vision is not None:
            ids, images = self._expand_images(ids, [bytes.fromhex(p["image"]) for p in image_parts(new)])
        parent, keep = attach(session, placement.base, ids, images)
        cut = keep - tree.path_length(session, placement.base)
        own = ids[cut:]
        own_images = tuple(i._replace(offset=i.offset - cut) for i in images if i.offset >= cut)
        return NewInput(placement, ids, text, parent, keep, own, history_length, tuple(images), own_images)

    def _previous_turn(self, session: Session, request: ChatRequest) -> int:
        """The recorded turn a request continues (`request.previous`), checked: delivered, and the tool
        results that open the request answer calls its reply made."""
        turn = request.previous
        assert turn is not None
        if (
            not 0 <= turn < session.committed_turns
            or tree.digest_at(session.turn_end_digests, turn) == NO_DIGEST
        ):
            raise UnknownPreviousTurn(session.session_id, turn)
        results = [
            m["tool_call_id"] for m in itertools.takewhile(lambda m: m["role"] == "tool", request.messages)
        ]
        if results:
            made = {call["id"] for call in self._recorded_reply(session, turn, request).tool_calls}
            for call_id in results:
                if call_id not in made:
                    raise ToolResultWithoutCall(call_id, sorted(made))
        return turn

    def _recorded_reply(self, session: Session, turn: int, request: ChatRequest) -> Reply:
        """A recorded turn's reply, rebuilt from its ids as the client got it."""
        _, output_start, end = tree.bounds(session, turn)
        stop_token = session.turn_stop_tokens[turn]
        return self._replies.build(
            session.token_ids[output_start:end],
            None if stop_token == NO_STOP_TOKEN else stop_token,
            session.turn_stop_strings.get(turn),
            request.tools,
            bool(session.turn_flags[turn] & FLAG_PROMPT_OPENS_REASONING),
            f"{session.session_id}/{turn}",
        )

    def _expand_images(self, ids: array, digests: list[bytes]) -> tuple[array, list[ImageSpan]]:
        """The new ids with each image's placeholder expanded to the token count the model directory's
        image processor gives it (checked against the engine's answer before anything is recorded)."""
        vision = self._vision
        assert vision is not None
        placeholders = placeholder_offsets(ids, vision.image_token_id)
        if len(placeholders) != len(digests):
            raise TemplateFailed(
                f"the chat template rendered {len(placeholders)} image placeholders for the {len(digests)} "
                "images of the new messages (one per image is needed; an image placeholder written as "
                "text counts too)"
            )
        counted = []
        for digest in digests:
            info = self._image_store.info(digest)
            grid = vision.grid(info.width, info.height)
            counted.append((vision.tokens(grid), *grid, digest))
        return expand(ids, vision.image_token_id, counted)

    def engine_prompt(self, session: Session, new: NewInput) -> EnginePrompt:
        """The whole prompt of a new input: the base's path (a copy, a memcpy per piece) then the new
        ids; with images, collapsed to one placeholder per image for the engine."""
        base = new.placement.base
        expanded = tree.path_ids(session, base)
        offset = len(expanded)
        expanded.extend(new.ids)
        recorded = tree.path_images(session, base)
        if not recorded and not new.images:
            return EnginePrompt(expanded, expanded, [], 0)
        images = recorded + [i._replace(offset=i.offset + offset) for i in new.images]
        return EnginePrompt(collapse(expanded, images), expanded, images, len(recorded))

    def _check_expansion(self, prompt: EnginePrompt, generation: Generation) -> None:
        """The engine expanded the prompt's images as recorded and as the processor says, or the turn
        fails (nothing recorded): ids whose image runs differ from their images' grids cannot be
        trained on."""
        if not prompt.images or self._vision is None:
            return
        answered = generation.prompt_token_ids
        if answered is not None:
            problem = expansion_problem(
                answered, prompt.expanded, prompt.images, prompt.recorded_images, self._vision.image_token_id
            )
            if problem:
                self._counters.image_mismatches += 1
                raise UpstreamImageMismatch(problem)
        elif generation.prompt_tokens and generation.prompt_tokens != len(prompt.expanded):
            # An engine or gateway that does not answer prompt_token_ids: its count must agree.
            self._counters.image_mismatches += 1
            raise UpstreamImageMismatch(
                f"the engine counted {generation.prompt_tokens} prompt tokens; with its images expanded as "
                f"the model directory's preprocessor_config.json says the prompt has {len(prompt.expanded)}"
            )

    def _replay(self, session: Session, request: ChatRequest, digest: bytes) -> TurnResult | None:
        """The recorded answer of this request when it is a retry: the call its Idempotency-Key
        names (another request under that key is refused), else, unless a new sample is asked for,
        the latest call of an equal request."""
        call: int | None = None
        if request.idempotency_key is not None:
            call = session.idempotency_keys.get(idempotency_key_digest(request.idempotency_key))
            if call is not None and tree.digest_at(session.turn_request_digests, call) != digest:
                raise IdempotencyKeyReused(session.session_id)
        if call is None and not request.regenerate:
            call = tree.latest_call_of(session, digest)
        if call is None or call >= session.committed_turns:
            return None
        return self.recorded_result(session, call, request, replayed=True)

    def recorded_result(
        self, session: Session, call: int, request: ChatRequest, replayed: bool
    ) -> TurnResult:
        """A call's answer rebuilt from the record: the same bytes the client got the first time."""
        choices = []
        for turn in tree.calls(session)[call]:
            _, output_start, end = tree.bounds(session, turn)
            reply = self._recorded_reply(session, turn, request)
            finish = FINISH_NAMES.get(session.turn_finishes[turn], "stop")
            choices.append(
                Choice(
                    turn,
                    reply,
                    finish,
                    session.token_ids[output_start:end],
                    session.logprobs[output_start:end],
                    session.turn_stop_strings.get(turn),
                )
            )
        _, first_output, _ = tree.bounds(session, call)
        prompt_tokens = tree.path_length(session, call) - (tree.bounds(session, call)[2] - first_output)
        return TurnResult(call, choices, prompt_tokens, session.turn_created[call], replayed)

    async def _new_input(self, session: Session, request: ChatRequest) -> NewInput | TurnResult:
        """`plan`, in a worker thread when the messages are large: templating and tokenizing
        megabytes takes seconds, and the loop serves every other session meanwhile (HF tokenizers
        release the GIL while encoding). The session lock is held: nothing else changes it."""
        offload_from = self._limits.offload_templating_bytes
        if message_text_bytes(request.messages, stop_after=offload_from) < offload_from:
            return self.plan(session, request)  # the common turn: a thread hop costs more
        self._counters.turns_templated_off_loop += 1
        try:
            return await asyncio.to_thread(self.plan, session, request)
        finally:
            if self._after_large_turn is not None:
                self._after_large_turn()  # the tokenizer's native buffers were freed: give them back

    async def run_turn(self, session: Session, request: ChatRequest, timings: dict[str, float]) -> TurnResult:
        if self._in_flight.closed:
            raise ShuttingDown("the proxy is shutting down; retry on its replacement")
        if session.busy:
            self._counters.turns_busy_rejected += 1
            raise TurnInFlight(session.session_id)
        self._storage.require_writable("this turn was not run")
        t_lock = time.perf_counter()
        with self._in_flight.turn():
            return await self._locked_turn(session, request, timings, t_lock)

    def _check_branch_limit(self, session: Session, new: NewInput, n: int) -> None:
        leaves = tree.leaves(session)
        continues_leaf = new.parent in leaves and new.keep == tree.path_length(session, new.parent)
        after = len(leaves) + n - (1 if continues_leaf else 0)
        if after > self._limits.max_branches:
            raise TooManyBranches(session.session_id, self._limits.max_branches)

    async def _locked_turn(
        self, session: Session, request: ChatRequest, timings: dict[str, float], t_lock: float
    ) -> TurnResult:
        async with session.lock:  # uncontended: acquired without yielding
            t_tok = time.perf_counter()
            timings["lock_wait_ms"] = _ms(t_lock, t_tok)
            if session.closed:
                raise SessionEnded(session.session_id, session.close_reason)
            session.touch()
            # Images first (decoded, named and stored off the loop): history matching compares digests.
            pinned = await self._intake.take(request)
            try:
                if pinned.digests:
                    timings["images_ms"] = _ms(t_tok, time.perf_counter())
                return await self._planned_turn(session, request, timings, t_tok)
            finally:
                self._intake.release(pinned)

    async def _planned_turn(
        self, session: Session, request: ChatRequest, timings: dict[str, float], t_tok: float
    ) -> TurnResult:
        planned = await self._new_input(session, request)
        if isinstance(planned, TurnResult):
            self._counters.turns_replayed += 1
            return planned
        if session.finished:
            raise SessionFinished(session.session_id)
        new = planned
        self._check_branch_limit(session, new, request.n)
        prompt = self.engine_prompt(session, new)
        sampling = await self._sampling(request, new)
        # Routing replay: the rows this turn's path lacks start here (the rest are recorded already).
        routed_from = (
            None if self._storage.routing.shape is None else first_row(session, new.parent, new.keep)
        )
        t_up = time.perf_counter()
        timings["tokenize_ms"] = _ms(t_tok, t_up)
        samples, paused_s = await self._call_upstream(session, prompt, sampling, request.n, routed_from)
        t_rec = time.perf_counter()
        if paused_s > 0:
            timings["pause_wait_ms"] = round(paused_s * 1000, 3)
        timings["upstream_ms"] = round(_ms(t_up, t_rec) - paused_s * 1000, 3)
        result = await self._record(
            session, request, new, samples, len(prompt.expanded), timings, routed_from
        )
        timings["record_ms"] = _ms(t_rec, time.perf_counter())
        return result

    async def _sampling(self, request: ChatRequest, new: NewInput) -> dict:
        """The request's sampling parameters, with the grammar of a forced tool call (tool_grammar.py):
        built in a worker thread for many tools, kept for a session's later turns."""
        parser = self._replies.tool_parser
        # Think-tag reasoning comes before a forced call; harmony's analysis channel is the grammar's own.
        reasoning = self._replies.reasoning_parser
        build = functools.partial(
            tool_choice_grammar,
            request.tools,
            parser.name if parser else None,
            reasoning if isinstance(reasoning, ReasoningParser) else None,
            new.text,
        )
        many = request.tools is not None and len(request.tools.tools) >= OFFLOAD_TOOLS
        grammar = await asyncio.to_thread(build) if many else build()
        return request.sampling_params if grammar is None else {**request.sampling_params, "ebnf": grammar}

    async def _record(
        self,
        session: Session,
        request: ChatRequest,
        new: NewInput,
        samples: list[MergedTurn],
        prompt_tokens: int,
        timings: dict[str, float],
        routed_from: int | None = None,
    ) -> TurnResult:
        """Append every sample as a turn (siblings under the same prompt), journal them, and answer
        only once they are durable. Routing replay rows go to the routing store first (its size is
        put back with the session's if the turn cannot be made durable)."""
        routing = self._storage.routing
        key = routing_key(session.session_id, session.key_digest)
        routing_mark = routing.size(key)
        temperature, tempered = logprobs_tempered(self._engine_logprobs, request.sampling_params)
        opens_reasoning = prompt_opens_reasoning(new.text)
        idempotency = (
            None if request.idempotency_key is None else idempotency_key_digest(request.idempotency_key)
        )
        created = time.time()
        mark = session.mark()
        call = session.num_turns
        choices: list[Choice] = []
        pending: list[Pending] = []
        try:
            for index, turn in enumerate(samples):
                generation = turn.generation
                turn_index = session.num_turns
                stop_token = self._tokenizer.stop_token(generation.output_ids, generation.stop_token)
                reply = self._replies.build(
                    generation.output_ids,
                    stop_token,
                    generation.stop_string,
                    request.tools,
                    opens_reasoning,
                    f"{session.session_id}/{turn_index}",
                )
                if index == 0:
                    parent, keep, own, own_images = new.parent, new.keep, new.own_ids, new.own_images
                else:  # the same prompt as the first sample: stored once, under it
                    parent, keep, own, own_images = call, new.keep + len(new.own_ids), array("i"), ()
                recorded = RecordedTurn(
                    own,
                    generation.output_ids,
                    generation.logprobs,
                    message_count=new.history_length + 1,
                    history_digest=extend_digest(new.placement.history_digest, [reply.message()]),
                    stopped=stop_token is not None,
                    stop_token=stop_token,
                    model_version=turn.version,
                    version_changes=tuple(turn.version_changes),
                    temperature=temperature,
                    tempered=tempered,
                    parent=parent,
                    keep=keep,
                    call=call,
                    request_digest=new.placement.request_digest,
                    finish=FINISH_CODES.get(generation.finish_reason, FINISH_UNKNOWN),
                    flags=FLAG_PROMPT_OPENS_REASONING if opens_reasoning else 0,
                    created=created,
                    stop_string=generation.stop_string,
                    idempotency_key=idempotency if index == 0 else None,
                    images=own_images,
                    routing=self._own_rows(session, turn, parent, keep, len(own), routed_from),
                )
                if recorded.routing is not None:
                    await routing.append(key, recorded.routing)
                self._store.record_growth(session.append_turn(recorded))
                # In the append's synchronous step: the journal's order is the order of the changes.
                pending.append(self._storage.turn(session, turn_index, recorded))
                choices.append(
                    Choice(
                        turn_index,
                        reply,
                        generation.finish_reason,
                        generation.output_ids,
                        generation.logprobs,
                        generation.stop_string,
                    )
                )
            t_journal = time.perf_counter()
            for record in pending:
                await self._storage.commit(record)
            timings["journal_ms"] = _ms(t_journal, time.perf_counter())
        except Failure:
            # Not durable, so not delivered: the session is as it was, the client may retry the turn.
            await routing.truncate(key, routing_mark)
            removed = session.rollback(mark)
            if not session.closed:
                self._store.record_growth(-removed)
            self._counters.turns_failed += 1
            raise
        session.committed_turns = session.num_turns
        session.touch()
        self._counters.turns += len(samples)
        return TurnResult(call, choices, prompt_tokens, created)

    def _own_rows(
        self, session: Session, turn: MergedTurn, parent: int, keep: int, own: int, routed_from: int | None
    ) -> bytes | None:
        """A sample's rows as its turn stores them: the turn's rows from the first its own place in
        the tree lacks (a sibling sample shares the first's prompt rows, stored with the first)."""
        shape = self._storage.routing.shape
        if routed_from is None or turn.routing is None or shape is None:
            return None
        start = first_row(session, parent, keep)
        rows = turn.routing[max(0, start - routed_from) * shape.row_bytes :]
        expected = max(0, keep + own + len(turn.generation.output_ids) - 1 - start)
        if len(rows) != expected * shape.row_bytes:
            raise UpstreamRoutingMissing(f"the turn has {len(rows)} bytes of routing, not {expected} rows")
        return rows

    async def _routing(
        self, routed_from: int, prompt: EnginePrompt, segments: list[Segment], merged: MergedTurn
    ) -> MergedTurn:
        """The merged sample with its routing rows (decoded in a worker thread when large)."""
        shape = self._storage.routing.shape
        assert shape is not None
        args = (routed_from, len(prompt.expanded), segments, shape)
        size = sum(len(s.generation.routed_experts or "") for s in segments)
        try:
            rows = (
                await asyncio.to_thread(turn_rows, *args)
                if size >= self._limits.offload_routing_bytes
                else turn_rows(*args)
            )
        except RoutingError as exc:
            raise UpstreamRoutingMissing(str(exc)) from None
        return replace(merged, routing=rows)

    async def _generate(
        self, prompt: EnginePrompt, sampling: dict, session: Session, n: int, routed_from: int | None = None
    ) -> tuple[list[MergedTurn], float]:
        """Pass the pause gate, then generate n samples; an aborted sample passes the gate again (so it
        waits for the resume) and continues with its tokens kept. Returns the samples and the seconds
        held by pauses."""
        paused_total = 0.0
        rid = f"{session.session_id}-{session.num_turns}-{secrets.token_hex(4)}"
        sample_segments: list[list[Segment]] = [[] for _ in range(n)]
        try:
            proxy_version, paused_s = await self._generation.enter()
            paused_total += paused_s
            try:
                if n == 1:
                    first = [
                        await self._upstream.generate(
                            prompt.ids, sampling, session.session_id, f"{rid}-0", prompt.digests, routed_from
                        )
                    ]
                else:
                    first = await self._upstream.generate_samples(
                        prompt.ids, sampling, n, session.session_id, f"{rid}-0", prompt.digests, routed_from
                    )
            finally:
                self._generation.leave()
            for generation in first:
                self._check_expansion(prompt, generation)
            for segments, generation in zip(sample_segments, first, strict=True):
                segments.append(Segment(generation, engine_version(generation.weight_version, proxy_version)))
            for index, segments in enumerate(sample_segments):
                paused_total += await self._ride_through_aborts(
                    prompt, sampling, session, segments, f"{rid}-{index}", routed_from
                )
            merged = []
            for segments in sample_segments:
                turn = merge_segments(segments, int(sampling["max_new_tokens"]), self._tokenizer.decode)
                if routed_from is not None:
                    turn = await self._routing(routed_from, prompt, segments, turn)
                merged.append(turn)
        except BaseException:
            # Tokens an engine made before an abort that could not be continued: counted, not hidden.
            self._counters.generated_tokens_discarded += sum(
                len(s.generation.output_ids) for segments in sample_segments for s in segments
            )
            raise
        for segments in sample_segments:
            self._counters.generated_tokens_continued += sum(
                len(s.generation.output_ids) for s in segments[:-1]
            )
        return merged, paused_total

    async def _ride_through_aborts(
        self,
        prompt: EnginePrompt,
        sampling: dict,
        session: Session,
        segments: list[Segment],
        rid: str,
        routed_from: int | None = None,
    ) -> float:
        """Resubmit a sample the engine aborted, with every token made so far, until it finishes. A
        trainer aborts the engine around weight updates without telling the proxy: while aborts make
        no token (the engine is still updating or paused) the resubmissions back off
        (`abort_backoff_s`), and the turn fails only when the engine has not finished it within
        `abort_ride_through_s` of the first abort. Returns the seconds held at the proxy's own gate."""
        last = segments[-1].generation
        request = self._continuation(prompt, sampling, segments) if last.aborted else None
        started = time.monotonic()
        idle_aborts = 0
        paused_s = 0.0
        attempt = 0
        while request is not None:
            attempt += 1
            idle_aborts = idle_aborts + 1 if not last.output_ids else 0
            if time.monotonic() - started > self._limits.abort_ride_through_s:
                raise UpstreamAborted(attempt, last.abort_message, time.monotonic() - started)
            await asyncio.sleep(abort_backoff_s(idle_aborts, random.random()))
            self._counters.turns_continued += 1
            proxy_version, waited = await self._generation.enter()
            paused_s += waited
            start = None if routed_from is None else next_start(routed_from, len(prompt.expanded), segments)
            try:
                last = await self._upstream.generate(
                    request[0], request[1], session.session_id, f"{rid}-{attempt}", prompt.digests, start
                )
            finally:
                self._generation.leave()
            segments.append(Segment(last, engine_version(last.weight_version, proxy_version)))
            request = self._continuation(prompt, sampling, segments) if last.aborted else None
        return paused_s

    def _continuation(
        self, prompt: EnginePrompt, sampling: dict, segments: list[Segment]
    ) -> tuple[array, dict] | None:
        """What continues an aborted sample; a constrained one starts over from its prompt, its tokens
        counted as discarded (`restarts_after_abort`)."""
        if restarts_after_abort(sampling):
            self._counters.generated_tokens_discarded += sum(len(s.generation.output_ids) for s in segments)
            segments.clear()
        return continuation_request(prompt.ids, sampling, segments)

    async def _call_upstream(
        self, session: Session, prompt: EnginePrompt, sampling: dict, n: int, routed_from: int | None = None
    ) -> tuple[list[MergedTurn], float]:
        # One task for the wait at the gate and the call: a DELETE, the drain or a departed client
        # cancels either, which closes the upstream connection and so aborts the engine's request.
        task = asyncio.create_task(self._generate(prompt, sampling, session, n, routed_from))
        try:
            with self._in_flight.generation(session, task) as generation:
                await asyncio.wait({task})
        finally:
            if not task.done():
                task.cancel()  # our own request was cancelled (the server's shutdown): nothing is recorded
        if task.cancelled() or session.closed:
            self._counters.turns_cancelled += 1
            if session.closed:
                raise SessionDeleted(session.session_id)
            if generation.cancelled_by is CancelCause.CLIENT_GONE:
                self._counters.turns_client_gone += 1
                raise ClientGone(session.session_id)
            raise ShuttingDown("the proxy shut down during this turn; nothing was recorded")
        try:
            return task.result()
        except PauseOutlasted:
            self._counters.turns_pause_timeouts += 1
            raise
        except ShuttingDown:  # the gate closed for shutdown while the turn waited
            self._counters.turns_cancelled += 1
            raise
        except Failure:  # upstream failures, aborts
            self._counters.turns_failed += 1
            raise
