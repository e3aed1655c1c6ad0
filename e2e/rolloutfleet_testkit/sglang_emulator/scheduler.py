"""The emulator's scheduler: continuous batching, pause modes, aborts and weight updates as SGLang's
TokenizerManager and Scheduler do them (a TEST STAND-IN; a tiny CPU model instead of a GPU one).

Behaviours and where SGLang has them:
- Every running request advances one token per step, together (`Scheduler.run_batch`); a step's
  model work runs in a worker thread so the event loop keeps serving.
- `pause(mode)` (`TokenizerManager.pause_generation`): `abort` aborts every running request (they
  answer HTTP 200 with `finish_reason {"type": "abort"}` and the tokens made so far); `in_place`
  keeps them where they are; `retract` sends them back to the waiting queue, to be prefilled again
  (input plus output so far) after the resume. New requests wait while paused
  (`is_pause_cond`), in every mode. `resume()` is `/continue_generation`.
- `update_weights(seed, version)` (`update_weights_from_disk`): while paused it loads at once;
  otherwise it waits for running requests to finish, or aborts them with `abort_all_requests`.
  It flushes the prefix cache and sets `weight_version` (`server_args.weight_version`), which
  every answer reports. New requests wait while weights load.
- `abort(rid)` / `abort(all)` (`/abort_request`); a client that goes away aborts its request.
- A finished request's `(input + output)[:-1]` goes into the radix cache; a new request reports the
  cached prefix of its input as `cached_tokens` (`radix_cache.py`). A request with max_new_tokens 0
  is prefill-only (`Req.is_prefill_only`): it ends at once with finish length 0, its whole input
  cached (the prefill's one sampled token has no KV).
- Constrained decoding (`grammar.py`, xgrammar as SGLang's default backend): a request with a grammar
  has its next token's logits masked to what the grammar allows, before sampling and for its logprob,
  and ends when the grammar has terminated (`Req.check_finished`).
- Routing replay (a mixture-of-experts model): each position the model consumes is routed
  (`model.route`); a request keeps the routing of every position it forwarded, prefill and decode, as
  SGLang's capturer keeps it per KV slot (`RoutedExpertsCapturer`), recomputed when a retracted
  request is prefilled again (the same weights: the same rows, as its cached slots would hold).
- Parallel sampling (`submit_group`, `TokenizerManager._handle_batch_request` with n > 1): the group
  passes the pause gate once; a prefill-only request puts the prompt in the cache ("Cache the common
  prefix for parallel sampling"), then the n samples run as n independent requests, each with its own
  rid and random stream, in the batch with everything else.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from .grammar import TokenMask
from .model import DEFAULT_SAMPLING_SEED, MoeHidden, TinyCausalLM, nucleus_sample, token_logprob
from .protocol import Sampling, finish_reason
from .radix_cache import RadixCache

PAUSE_MODES = ("abort", "retract", "in_place")
ENDED_KEPT = 1000  # the most recent ended requests /emulator_stats lists (rid, finish, tokens)


@dataclass(eq=False)
class Request:
    rid: str
    input_ids: list[int]  # the prompt as the prefix cache keys it
    sampling: Sampling
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: dict | None = None
    cached_tokens: int = 0
    text: str = ""  # decoded output, kept only when stop strings need it
    created: float = field(default_factory=time.perf_counter)
    # Model state after the last consumed token; None: to prefill (new, or retracted).
    hidden: torch.Tensor | None = None
    next_logits: torch.Tensor | None = None
    generator: torch.Generator | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    # The output length after each step, then None when the request has ended (for streaming).
    steps: asyncio.Queue = field(default_factory=asyncio.Queue)
    # What the model embeds at the prompt's positions when that differs from input_ids (images).
    embed_ids: list[int] | None = None
    # The request's grammar state (grammar.py), when its sampling parameters constrain it.
    grammar: TokenMask | None = None
    # A mixture of experts: the routing of each position forwarded so far ([rows, layers, top_k] pieces).
    routing: list[np.ndarray] = field(default_factory=list)

    def routed_rows(self) -> np.ndarray | None:
        """The routing of every position forwarded (prompt, then output), or None if none was."""
        return np.concatenate(self.routing) if self.routing else None


class Scheduler:
    def __init__(
        self,
        model: TinyCausalLM,
        decode: Callable[[list[int]], str],
        cache_capacity_tokens: int,
        token_delay_s: float = 0.0,
        weight_version: str = "default",
        original_logprobs: bool = False,
        deterministic: bool = False,
        model_factory: Callable[[int], TinyCausalLM] | None = None,
        update_delay_s: float = 0.0,
    ):
        self.model = model
        self._decode = decode
        self.cache = RadixCache(cache_capacity_tokens)
        self.token_delay_s = token_delay_s
        self.weight_version = weight_version
        self.original_logprobs = original_logprobs
        self.deterministic = deterministic
        self._model_factory = model_factory
        self.update_delay_s = update_delay_s
        self.running: list[Request] = []
        self.paused = False
        self.pause_mode: str | None = None
        self.updating = False  # weights loading: new requests wait
        self._gate = asyncio.Condition()
        self._work = asyncio.Event()
        self._ended = asyncio.Event()  # set whenever a request ends
        self._step_lock = asyncio.Lock()  # held during a step; weights change only between steps
        self._seeds = DEFAULT_SAMPLING_SEED
        self.stats = {
            "requests": 0,
            "prompt_tokens": 0,
            "cached_tokens": 0,
            "generated_tokens": 0,
            "aborted": 0,
        }
        # What tests ask "did the engine stop decoding that rid": the latest ended requests.
        self.ended: collections.deque[dict] = collections.deque(maxlen=ENDED_KEPT)
        self._task: asyncio.Task | None = None

    # --- requests --------------------------------------------------------------------------------

    async def _open(self) -> None:
        async with self._gate:
            await self._gate.wait_for(lambda: not self.paused and not self.updating)

    async def submit(self, request: Request) -> Request:
        """Queue a request (waiting while paused or while weights load) and return it once it ends."""
        self._ensure_loop()
        await self._open()
        self._admit(request)
        await request.done.wait()
        return request

    async def submit_group(self, prefill: Request, samples: list[Request]) -> list[Request]:
        """Parallel sampling, as `TokenizerManager._handle_batch_request` runs a prompt with n > 1:
        `generate_request` passes the pause gate once for the whole group; `prefill` (the prompt with
        max_new_tokens 0) caches the common prefix; then each sample is sent as a request of its own.
        Returns the samples, in their order, once every one has ended."""
        self._ensure_loop()
        await self._open()
        self._admit(prefill)  # prefill-only: ends at once, its prompt cached before the samples match
        for sample in samples:
            self._admit(sample)
        await asyncio.gather(*(sample.done.wait() for sample in samples))
        return samples

    def _admit(self, request: Request) -> None:
        """Hand a request to the scheduler: match its prefix, give it its random stream, run it."""
        request.cached_tokens = self.cache.cached_tokens(request.input_ids)
        # SamplingBatchInfo takes each request's own sampling_seed: the n samples of a group carry the
        # same sampling_params, so under deterministic inference one seed makes them all alike.
        seed = request.sampling.seed if self.deterministic and request.sampling.seed is not None else None
        if seed is None:  # without deterministic inference SGLang ignores sampling_seed
            self._seeds += 1
            seed = self._seeds
        request.generator = torch.Generator().manual_seed(seed)
        self.stats["requests"] += 1
        self.stats["prompt_tokens"] += len(request.input_ids)
        self.stats["cached_tokens"] += request.cached_tokens
        if request.sampling.max_new_tokens == 0:
            # Prefill-only: the prefill samples one token, check_finished ends the request with
            # length 0 and cache_finished_req keeps (input + [that token])[:-1], the whole input.
            self.cache.insert(request.input_ids)
            request.finish = {"type": "length", "length": 0}
            request.done.set()
            request.steps.put_nowait(None)
            return
        self.running.append(request)
        self._work.set()

    async def abort(self, rid: str | None = None, message: str = "Abort request.") -> int:
        """End running requests (one by rid, or all) with finish abort; they keep their tokens. Between
        steps, so an aborted request's tokens no longer change once it has answered."""
        async with self._step_lock:
            return self._abort(rid, message)

    def _abort(self, rid: str | None = None, message: str = "Abort request.") -> int:
        aborted = 0
        for request in list(self.running):
            if rid is None or request.rid == rid:
                self._end(request, {"type": "abort", "message": message})
                aborted += 1
        self.stats["aborted"] += aborted
        return aborted

    def _end(self, request: Request, finish: dict) -> None:
        request.finish = finish
        tokens = len(request.output_ids)
        self.ended.append({"rid": request.rid, "finish": finish["type"], "output_tokens": tokens})
        if request in self.running:
            self.running.remove(request)
        if finish["type"] != "abort":
            self.cache.insert((request.input_ids + request.output_ids)[:-1])
        request.done.set()
        request.steps.put_nowait(None)
        self._ended.set()

    # --- pause, weights --------------------------------------------------------------------------

    async def pause(self, mode: str) -> int:
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {', '.join(PAUSE_MODES)}")
        async with self._step_lock:  # the current step ends first
            self.paused, self.pause_mode = True, mode
            if mode == "abort":
                return self._abort(message="Abort by pause_generation.")
            if mode == "retract":
                for request in self.running:
                    request.hidden = request.next_logits = None  # prefilled again after the resume
            return len(self.running)

    async def resume(self) -> None:
        async with self._gate:
            self.paused, self.pause_mode = False, None
            self._gate.notify_all()
        self._work.set()

    async def update_weights(self, seed: int, version: str | None, abort_all: bool) -> dict:
        paused_requests = len(self.running) if self.paused else 0
        if not self.paused:
            if abort_all:
                await self.abort(message="Abort by update_weights.")
            async with self._gate:  # new requests wait from now on
                self.updating = True
            while self.running:  # the model-update writer lock waits for running requests
                self._ended.clear()
                await self._ended.wait()
        try:
            if self.update_delay_s > 0:
                await asyncio.sleep(self.update_delay_s)
            async with self._step_lock:
                if self._model_factory is None:
                    return {"success": False, "message": "this emulator cannot load weights"}
                self.model = await asyncio.to_thread(self._model_factory, seed)
                self.cache.reset()  # flush_cache defaults to True
                if version is not None:
                    self.weight_version = version
        finally:
            async with self._gate:
                self.updating = False
                self._gate.notify_all()
        return {
            "success": True,
            "message": "Succeeded to update model weights.",
            "num_paused_requests": paused_requests,
        }

    async def set_weight_version(self, version: str, abort_all: bool) -> None:
        if abort_all:
            await self.abort(message="Abort by update_weight_version.")
        self.weight_version = version

    # --- the loop --------------------------------------------------------------------------------

    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="emulator-scheduler")

    async def _run(self) -> None:
        while True:
            await self._work.wait()
            if not self.running or self.paused or self.updating:
                self._work.clear()
                continue
            async with self._step_lock:
                batch = list(self.running)
                results = await asyncio.to_thread(self._step, batch)
            for request, finish in results:
                if request.finish is None and request in self.running:  # not aborted meanwhile
                    request.steps.put_nowait(len(request.output_ids))
                    if finish is not None:
                        self._end(request, finish)
            if self.token_delay_s > 0:
                await asyncio.sleep(self.token_delay_s)
            else:
                await asyncio.sleep(0)

    def _step(self, batch: list[Request]) -> list[tuple[Request, dict | None]]:
        """One token for every request of the batch (worker thread)."""
        model = self.model
        out = []
        with torch.no_grad():
            for request in batch:
                if request.hidden is None:  # prefill: the input and any output made before a retract
                    prompt = request.input_ids if request.embed_ids is None else request.embed_ids
                    ids = torch.tensor(prompt + request.output_ids, dtype=torch.long)
                    logits, request.hidden = model(ids, last_only=True)
                    request.next_logits = logits[-1]
                    if isinstance(request.hidden, MoeHidden):
                        request.routing = [request.hidden.routing]
                assert request.next_logits is not None
                token, logprob = self._choose(model, request)
                request.output_ids.append(token)
                request.logprobs.append(logprob)
                self.stats["generated_tokens"] += 1
                if request.sampling.stop_strings:
                    request.text = self._decode(request.output_ids)
                terminated = request.grammar is not None and request.grammar.terminated
                finish = finish_reason(request.output_ids, request.text, request.sampling, terminated)
                if finish is None:
                    logits, request.hidden = model(torch.tensor([token], dtype=torch.long), request.hidden)
                    request.next_logits = logits[-1]
                    if isinstance(request.hidden, MoeHidden):
                        request.routing.append(request.hidden.routing)
                out.append((request, finish))
        return out

    def _choose(self, model: TinyCausalLM, request: Request) -> tuple[int, float]:
        sampling = request.sampling
        assert request.next_logits is not None and request.generator is not None
        logits = model.final_logits(request.next_logits, len(request.output_ids))
        if len(request.output_ids) < sampling.min_new_tokens and sampling.stop_token_ids:
            logits = logits.clone()
            logits[list(sampling.stop_token_ids)] = float("-inf")  # min_new_tokens' logit penalty
        if request.grammar is not None:  # apply_logits_bias: the vocab mask before sampling
            logits = request.grammar.masked(logits)
        if sampling.temperature == 0:
            token = int(torch.argmax(logits))
        else:
            filtered = logits
            if sampling.top_k > 0:
                kth = torch.topk(logits, min(sampling.top_k, logits.numel())).values[-1]
                filtered = logits.masked_fill(logits < kth, float("-inf"))
            token = nucleus_sample(filtered, sampling.temperature, sampling.top_p, request.generator)
        if request.grammar is not None:
            request.grammar.accept(token)
        return token, token_logprob(logits, token, sampling.temperature, self.original_logprobs)
