"""Constrained decoding as SGLang does it with its default grammar backend, xgrammar (the real library).

Each behaviour follows a named piece of SGLang's source (read, not copied):
- Which constraint a request has, and the refusal of two: `protocol.constraint_of`.
- `XGrammarGrammarBackend`: `TokenizerInfo.from_huggingface(tokenizer, vocab_size, stop_token_ids=the
  model's EOS ids)`, one `GrammarCompiler`; `dispatch_json` (`compile_json_schema`, "$$ANY$$" for any
  JSON), `dispatch_regex`, `dispatch_ebnf` (`compile_grammar`), `dispatch_structural_tag`
  (`compile_structural_tag`). A grammar that does not compile ends the request with HTTP 400
  "Invalid grammar request" (`set_finish_with_abort`, answered as a BadRequestError).
- `XGrammarGrammarObject`: a `GrammarMatcher` per request; before each token `fill_vocab_mask` and
  `apply_vocab_mask` (`apply_token_bitmask_inplace`: disallowed logits become -inf, so sampling and the
  reported logprobs both see the masked distribution); after it `accept_token`.
- `Req.check_finished`: after the max_new_tokens check, a grammar that `is_terminated()` (it accepted a
  stop token where the grammar may end) finishes the request as matching that token.
- A request that requires reasoning is left unconstrained until the reasoning ends only on an engine
  started with `--reasoning-parser` and a request carrying `require_reasoning` (`ReasonerGrammarObject.
  maybe_init_reasoning`); sglang-router 0.3.2 drops that field, so here the grammar applies from the
  first output token, as it does behind the router.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from .protocol import BadRequest

ANY_JSON = "$$ANY$$"  # json_schema for any JSON value (SGLang's dispatch_json)


class GrammarBackend:
    """xgrammar over the emulator's tokenizer. The tokenizer's info is built on the first constrained
    request (a second or two for a 150k vocabulary); compiled grammars are cached by the compiler."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._compiler: Any = None
        self._lock = threading.Lock()

    def _ready_compiler(self) -> Any:
        import xgrammar

        with self._lock:
            if self._compiler is None:
                info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_token_ids
                )
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def compile(self, kind: str, value: str) -> Any:
        """The compiled grammar (CPU-bound: call it off the event loop); BadRequest when it is invalid."""
        compiler = self._ready_compiler()
        try:
            if kind == "json_schema":
                if value == ANY_JSON:
                    return compiler.compile_builtin_json_grammar()
                return compiler.compile_json_schema(value)
            if kind == "regex":
                return compiler.compile_regex(value)
            if kind == "ebnf":
                return compiler.compile_grammar(value)
            return compiler.compile_structural_tag(value)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise BadRequest(f"Invalid grammar request: {kind}: {exc}") from None

    def matcher(self, compiled: Any) -> TokenMask:
        return TokenMask(compiled, self._vocab_size)


class TokenMask:
    """One request's grammar state: masks the next token's logits and follows the chosen tokens."""

    def __init__(self, compiled: Any, vocab_size: int):
        import xgrammar

        self._xgrammar = xgrammar
        self._matcher = xgrammar.GrammarMatcher(compiled)
        self._bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits with every token the grammar forbids at -inf (a copy)."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        masked = logits.clone().unsqueeze(0)
        self._xgrammar.apply_token_bitmask_inplace(masked, self._bitmask)
        return masked.squeeze(0)

    def accept(self, token: int) -> None:
        if not self._matcher.accept_token(token):
            # Cannot happen for a token chosen under the mask; SGLang logs and aborts the request.
            raise RuntimeError(f"the grammar rejected token {token} it allowed")

    @property
    def terminated(self) -> bool:
        return bool(self._matcher.is_terminated())
