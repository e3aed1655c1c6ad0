"""The SGLang emulator's model: a TEST STAND-IN for the LLM a GPU SGLang server would run.

A tiny randomly initialised causal LM (embedding, one GRU layer, linear head). Its weights come
only from a seed, so every process that loads it with the same seed computes the same logits;
that lets tests check token ids and logprobs recorded elsewhere against `score()`.

Logprob convention (SGLang's `output_token_logprobs`, `Sampler.forward`): when sampling, the
log-softmax of the logits divided by the temperature at the chosen token; when decoding greedily
(temperature 0), or with `original=True` (SGLANG_RETURN_ORIGINAL_LOGPROB=1), the log-softmax of the
logits themselves. Top-p only changes which token is chosen. `score(..., temperature=T)` computes
either.

Mixture of experts (a model directory whose config.json names experts, as SGLang's `hf_text_config`
does: `num_hidden_layers`, `num_experts_per_tok` and `num_experts`, `n_routed_experts` or
`num_local_experts`): every position is routed, at each of the layers, to top-k of the experts, and
the chosen experts' vectors are added to its state before the head, so routing changes what the model
says. The router scores each expert by a hash of the ids up to and including the position, the layer,
the expert and the weights' seed: causal like a real router (a token's routing depends on its whole
prefix), different after a weight update, and exact integers, so a prefill, a decode step and the
reference `route()` over the whole sequence agree to the bit (a float router's near-ties would not).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np
import torch
from torch import nn

EMBED_DIM = 48
HIDDEN_DIM = 64

# A random model almost never picks EOS by itself, so replies would always run to
# max_new_tokens. This bonus is added to the EOS logit at output position n as n * bonus, so
# replies end after roughly 8-40 tokens. It is part of the model's logits: the chosen token and
# its reported logprob both come from the boosted logits, and score() applies it the same way.
EOS_BONUS_PER_TOKEN = 0.4

# Sampling without a seed still uses a fixed one: the stand-in is reproducible by design.
DEFAULT_SAMPLING_SEED = 0

Finish = Literal["stop", "length"]


class GenerationResult(NamedTuple):
    output_ids: list[int]
    logprobs: list[float]
    finish: Finish


# Where config.json names the expert count (Qwen-MoE; DeepSeek, Kimi, GLM; Mixtral, gpt-oss).
EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")
EXPERT_MIX_SCALE = 0.3  # how much the chosen experts move a state (enough to change some tokens)
_PREFIX_MODULUS = (1 << 61) - 1


@dataclass(frozen=True)
class MoeConfig:
    layers: int
    top_k: int
    experts: int

    @classmethod
    def from_model_config(cls, config: dict[str, Any]) -> MoeConfig | None:
        """The experts of a config.json (a vision-language model's `text_config`); None: dense."""
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        experts = next((text[k] for k in EXPERT_COUNT_KEYS if isinstance(text.get(k), int)), None)
        if experts is None:
            return None
        return cls(int(text["num_hidden_layers"]), int(text["num_experts_per_tok"]), int(experts))


class MoeHidden(NamedTuple):
    """A mixture-of-experts model's state after a call: the GRU's, the hash of every id it consumed,
    and the routing [positions, layers, top_k] (int32) of the positions that call consumed."""

    gru: torch.Tensor
    prefix: int
    routing: np.ndarray


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise on uint64 (numpy arrays wrap on overflow)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def route(ids: Sequence[int], seed: int, moe: MoeConfig, prefix: int = 0) -> tuple[np.ndarray, int]:
    """The routing [len(ids), layers, top_k] (int32, each position's experts by descending score) of
    `ids` consumed after a prefix whose hash is `prefix`, and the hash after them."""
    hashes = np.empty(len(ids), np.uint64)
    for i, token in enumerate(ids):
        prefix = (prefix * 1000003 + int(token) + 1) % _PREFIX_MODULUS
        hashes[i] = prefix
    layer = np.arange(moe.layers, dtype=np.uint64)[None, :, None] << np.uint64(48)
    expert = np.arange(moe.experts, dtype=np.uint64)[None, None, :] << np.uint64(24)
    keys = (hashes[:, None, None] * np.uint64(0x9E3779B97F4A7C15)) ^ layer ^ expert ^ np.uint64(seed)
    order = np.argsort(_mix64(keys), axis=-1, kind="stable")[..., ::-1][..., : moe.top_k]
    return np.ascontiguousarray(order, dtype=np.int32), prefix


class TinyCausalLM(nn.Module):
    """Embedding -> GRU -> linear head; float32 on CPU, weights drawn from `seed` only."""

    def __init__(
        self,
        vocab_size: int,
        seed: int = 0,
        eos_token_id: int | None = None,
        eos_bonus_per_token: float = EOS_BONUS_PER_TOKEN,
        moe: MoeConfig | None = None,
    ) -> None:
        super().__init__()
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be at least 2, got {vocab_size}")
        if eos_token_id is not None and not 0 <= eos_token_id < vocab_size:
            raise ValueError(f"eos_token_id {eos_token_id} outside vocabulary of {vocab_size}")
        self.vocab_size = vocab_size
        self.seed = seed
        self.eos_token_id = eos_token_id
        self.eos_bonus_per_token = eos_bonus_per_token
        self.moe = moe
        # The layers' default initialisers draw from the global RNG that torch.manual_seed
        # controls; fork_rng puts its state back, and _init_weights overwrites every weight.
        with torch.random.fork_rng(devices=[]):
            self.embed = nn.Embedding(vocab_size, EMBED_DIM)
            self.gru = nn.GRU(EMBED_DIM, HIDDEN_DIM, batch_first=True)
            self.head = nn.Linear(HIDDEN_DIM, vocab_size)
            if moe is not None:  # after the dense layers: their weights stay those of the same seed
                self.experts = nn.Parameter(torch.empty(moe.layers, moe.experts, HIDDEN_DIM))
        self._init_weights(seed)
        self.requires_grad_(False)  # inference only; also keeps worker threads free of autograd
        self.eval()

    def _init_weights(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        # Scales found by trying: a strong recurrence so the reply depends on the whole prompt,
        # not only on its last few (template) tokens, and head logits spread over a few nats.
        scales = {"embed": 1.0, "gru": 3.0 / HIDDEN_DIM**0.5, "head": 0.6, "experts": 1.0}
        with torch.no_grad():
            for name, param in self.named_parameters():
                values = torch.randn(param.shape, generator=generator, dtype=torch.float32)
                param.copy_(values * scales[name.split(".")[0]])

    def forward(self, input_ids: torch.Tensor, hidden: Any = None, last_only: bool = False):
        """input_ids: 1-D LongTensor. Returns (logits [T, V], or [1, V] of the last position with
        `last_only`, and the hidden state for continuing: a MoeHidden, with the call's routing, for a
        mixture of experts). A prefill needs only the last: the logits of every position of a
        50k-token prompt over a 151k vocabulary would be 30 GB."""
        moe, prefix = self.moe, 0
        if isinstance(hidden, MoeHidden):
            hidden, prefix = hidden.gru, hidden.prefix
        states, hidden = self.gru(self.embed(input_ids).unsqueeze(0), hidden)
        states = states.squeeze(0)
        if moe is not None:
            routing, prefix = route(input_ids.tolist(), self.seed, moe, prefix)
            chosen = torch.from_numpy(routing[-1:] if last_only else routing).long()
            mixed = self.experts[torch.arange(moe.layers)[None, :, None], chosen].sum(dim=(1, 2))
            states = (states[-1:] if last_only else states) + EXPERT_MIX_SCALE * mixed
            return self.head(states), MoeHidden(hidden, prefix, routing)
        return self.head(states[-1:] if last_only else states), hidden

    def final_logits(self, raw_logits: torch.Tensor, position: int | torch.Tensor) -> torch.Tensor:
        """The logits that decide output position(s) `position` (0-based): raw plus the EOS
        bonus. Works for one step ([V], int) and for a teacher-forced block ([T, V], [T])."""
        if self.eos_token_id is None:
            return raw_logits
        boosted = raw_logits.clone()
        boosted[..., self.eos_token_id] += self.eos_bonus_per_token * position
        return boosted


def load_model(
    tokenizer: str | os.PathLike | int,
    seed: int = 0,
    eos_token_id: int | None = None,
    moe: MoeConfig | None = None,
) -> TinyCausalLM:
    """Build the model for a tokenizer directory (vocab = len(tokenizer), EOS = its eos token; a
    mixture of experts when its config.json names experts) or for a plain vocabulary size (EOS bonus
    only if eos_token_id is given; experts only if `moe` is given)."""
    if isinstance(tokenizer, int):
        return TinyCausalLM(tokenizer, seed=seed, eos_token_id=eos_token_id, moe=moe)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.fspath(tokenizer))
    eos = tok.eos_token_id if eos_token_id is None else eos_token_id
    return TinyCausalLM(len(tok), seed=seed, eos_token_id=eos, moe=moe or model_moe(tokenizer))


def model_moe(model_dir: str | os.PathLike) -> MoeConfig | None:
    """The experts the model directory's config.json names, if any."""
    import json

    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return MoeConfig.from_model_config(config) if isinstance(config, dict) else None


def _check_ids(model: TinyCausalLM, ids: Iterable[int], what: str) -> list[int]:
    ids = list(ids)
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < model.vocab_size:
            raise ValueError(f"{what} holds {token!r}, not a token id in [0, {model.vocab_size})")
    return ids


def token_logprob(logits: torch.Tensor, token: int, temperature: float, original: bool = False) -> float:
    """SGLang's reported logprob of `token`: log_softmax(logits / temperature) on the sampling path,
    log_softmax(logits) when greedy or with the original-logprob switch (`Sampler.forward`)."""
    scaled = logits if original or temperature == 0 else logits / temperature
    return float(torch.log_softmax(scaled, dim=-1)[token])


def nucleus_sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True, stable=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
        keep = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) < top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


def iter_generate(
    model: TinyCausalLM,
    input_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop_token_ids: Iterable[int] = (),
    original_logprobs: bool = False,
) -> Iterator[tuple[int, float]]:
    """Yield (token_id, logprob) one output token at a time; see `generate`.

    Each step is independent of the calling thread (no thread-local grad mode is entered), so a
    server may advance the iterator from different worker threads.
    """
    prompt = _check_ids(model, input_ids, "input_ids")
    if not prompt:
        raise ValueError("input_ids must not be empty")
    if max_new_tokens < 0:
        raise ValueError("max_new_tokens must be >= 0")
    if temperature < 0:
        raise ValueError("temperature must be >= 0")
    if not 0 < top_p <= 1:
        raise ValueError("top_p must be in (0, 1]")
    stops = set(stop_token_ids)
    generator = torch.Generator().manual_seed(DEFAULT_SAMPLING_SEED if seed is None else seed)
    if max_new_tokens == 0:
        return
    # The last position only, as the scheduler's prefill (the same arithmetic, so the same logprobs).
    logits, hidden = model(torch.tensor(prompt, dtype=torch.long), last_only=True)
    raw = logits[-1]
    for position in range(max_new_tokens):
        final = model.final_logits(raw, position)
        if temperature == 0:
            token = int(torch.argmax(final))
        else:
            token = nucleus_sample(final, temperature, top_p, generator)
        yield token, token_logprob(final, token, temperature, original_logprobs)
        if token in stops or position + 1 == max_new_tokens:
            return
        logits, hidden = model(torch.tensor([token], dtype=torch.long), hidden)
        raw = logits[-1]


def generate(
    model: TinyCausalLM,
    input_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop_token_ids: Iterable[int] = (),
) -> GenerationResult:
    """Decode up to max_new_tokens after input_ids.

    Greedy when temperature == 0, else nucleus sampling from a generator seeded with `seed`
    (DEFAULT_SAMPLING_SEED when None). A generated stop token is kept in output_ids, as SGLang
    does, and makes finish "stop"; otherwise finish is "length".
    """
    stops = set(stop_token_ids)
    steps = list(iter_generate(model, input_ids, max_new_tokens, temperature, top_p, seed, stops))
    output_ids = [token for token, _ in steps]
    finish: Finish = "stop" if output_ids and output_ids[-1] in stops else "length"
    return GenerationResult(output_ids, [logprob for _, logprob in steps], finish)


def score(
    model: TinyCausalLM, prompt_ids: list[int], output_ids: list[int], temperature: float = 1.0
) -> list[float]:
    """Teacher-forced logprobs of output_ids after prompt_ids, by the generate() convention at
    `temperature` (1.0, or 0 for greedy: the raw log-softmax; else tempered).

    The whole sequence goes through the GRU in one call (generate steps token by token), so this
    is an independent check of what generate reported, equal to within float rounding.
    """
    prompt = _check_ids(model, prompt_ids, "prompt_ids")
    outputs = _check_ids(model, output_ids, "output_ids")
    if not prompt:
        raise ValueError("prompt_ids must not be empty")
    if not outputs:
        return []
    sequence = torch.tensor(prompt + outputs[:-1], dtype=torch.long)
    logits, _ = model(sequence)
    positions = torch.arange(len(outputs))
    # Row len(prompt)-1+i predicts output position i.
    decisive = model.final_logits(logits[len(prompt) - 1 :], positions)
    if temperature not in (0, 1):
        decisive = decisive / temperature
    logprobs = torch.log_softmax(decisive, dim=-1)[positions, torch.tensor(outputs)]
    return logprobs.tolist()
