"""An independent check of constrained generation, for the emulator's and the proxy's tests: the model's
logprobs of recorded output ids, teacher-forced in one pass (as `model.score`), each masked by a fresh
xgrammar matcher of the grammar the engine was given. It shares nothing with the emulator's scheduler
but the model and xgrammar itself."""

from __future__ import annotations

import torch
import xgrammar
from rolloutfleet_testkit.sglang_emulator.model import TinyCausalLM


def tokenizer_info(tokenizer) -> xgrammar.TokenizerInfo:
    return xgrammar.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=len(tokenizer), stop_token_ids=[tokenizer.eos_token_id]
    )


def masked_score(
    model: TinyCausalLM,
    info: xgrammar.TokenizerInfo,
    ebnf: str,
    prompt_ids: list[int],
    output_ids: list[int],
    temperature: float,
) -> tuple[list[float], bool]:
    """(the logprob of each output id under the grammar's mask, whether the grammar ended with them).
    AssertionError when the grammar forbids one of the ids."""
    matcher = xgrammar.GrammarMatcher(xgrammar.GrammarCompiler(info, max_threads=1).compile_grammar(ebnf))
    bitmask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
    with torch.no_grad():
        logits, _ = model(torch.tensor(prompt_ids + output_ids[:-1], dtype=torch.long))
        decisive = model.final_logits(logits[len(prompt_ids) - 1 :], torch.arange(len(output_ids)))
    logprobs = []
    for position, token in enumerate(output_ids):
        matcher.fill_next_token_bitmask(bitmask)
        row = decisive[position].clone().unsqueeze(0)
        xgrammar.apply_token_bitmask_inplace(row, bitmask)
        if temperature not in (0, 1):
            row = row / temperature
        logprobs.append(float(torch.log_softmax(row[0], dim=-1)[token]))
        assert matcher.accept_token(token), f"the grammar forbids output token {position} ({token})"
    return logprobs, bool(matcher.is_terminated())
