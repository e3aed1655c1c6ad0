"""The cost of enforcing tool_choice "required" or a named function (tool_grammar.py).

Two sides:
- The proxy: building the grammar of a request (`tool_choice_grammar`: the tools' JSON schemas and the
  family's call format as EBNF), CPU per request, and the bytes it adds to the /generate body, for
  1 to 128 tools and every tool-call parser. Pure Python in the proxy's process.
- The engine, as the SGLang emulator runs it with xgrammar (SGLang's default grammar backend) on this
  CPU: the tokenizer's grammar info (once per engine), compiling a request's grammar, and masking the
  logits before each token (`fill_next_token_bitmask` and `apply_token_bitmask_inplace`), with the
  test tokenizer (1,000 tokens) and Qwen's real vocabulary (151,665 tokens). A GPU engine applies the
  mask on the GPU and overlaps the CPU part with the forward pass; these are CPU figures.

The per-token walk follows random allowed tokens through the grammar (seeded) until it ends.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import xgrammar
from common import progress, save_result, tokenizer_dir
from rolloutfleet_proxy import tool_grammar
from rolloutfleet_proxy.chat_tools import parse_tools
from rolloutfleet_proxy.reasoning_parsers import reasoning_parser
from rolloutfleet_proxy.tool_grammar import CONSTRAINABLE_PARSERS, tool_choice_grammar
from rolloutfleet_testkit.model_families import FAMILIES
from transformers import AutoTokenizer


def tool(index: int, bounded: bool = True) -> dict:
    """A tool with a typical schema; `bounded`: its query string has a maxLength (costly for xgrammar:
    it compiles and masks a counted repetition against every token of the vocabulary)."""
    query = {"type": "string", "maxLength": 40} if bounded else {"type": "string"}
    return {
        "type": "function",
        "function": {
            "name": f"tool_{index}",
            "description": "A tool with a typical argument schema.",
            "parameters": {
                "type": "object",
                "properties": {
                    f"query_{index}": query,
                    "limit": {"type": "integer"},
                    "mode": {"enum": ["fast", "exact", "fuzzy"]},
                    "filters": {
                        "type": "array",
                        "items": {"type": "object", "properties": {"field": {"type": "string"}}},
                        "maxItems": 4,
                    },
                    "verbose": {"type": "boolean"},
                },
                "required": [f"query_{index}"],
            },
        },
    }


def median_us(call, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def proxy_side(repeat: int) -> list[dict]:
    """Building each grammar anew (the proxy keeps recent ones: a session's later turns cost a lookup)."""
    rows = []
    qwen3 = reasoning_parser("qwen3")
    tail = "<|im_start|>assistant\n"
    for count in (1, 8, 32, 128):
        tools = [tool(i) for i in range(count)]
        for parser in sorted(CONSTRAINABLE_PARSERS):
            reasoning = qwen3 if parser == "qwen25" else None  # Qwen3: an optional think block first

            def build(parser=parser, reasoning=reasoning, tools=tools) -> str | None:
                tool_grammar._GRAMMARS.clear()
                spec = parse_tools({"tools": tools, "tool_choice": "required"})
                return tool_choice_grammar(spec, parser, reasoning, tail)

            grammar = build()
            assert grammar is not None
            us = median_us(build, repeat)
            spec = parse_tools({"tools": tools, "tool_choice": "required"})
            cached_us = median_us(
                lambda spec=spec, p=parser, r=reasoning: tool_choice_grammar(spec, p, r, tail), repeat
            )
            rows.append(
                {
                    "tools": count,
                    "parser": parser,
                    "build_us": round(us, 1),
                    "kept_us": round(cached_us, 1),
                    "ebnf_bytes": len(grammar),
                }
            )
            progress(
                f"proxy: {count} tools, {parser}: {us:.0f} us, kept {cached_us:.0f} us, {len(grammar)} B"
            )
    return rows


def engine_side(name: str, path: str, tokens: int) -> list[dict]:
    tokenizer = AutoTokenizer.from_pretrained(path)
    start = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=len(tokenizer), stop_token_ids=[tokenizer.eos_token_id]
    )
    info_s = time.perf_counter() - start
    rows = []
    for bounded in (False, True):
        compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        spec = parse_tools({"tools": [tool(i, bounded) for i in range(8)], "tool_choice": "required"})
        grammar = tool_choice_grammar(spec, "qwen25", None, "")
        assert grammar is not None
        start = time.perf_counter()
        compiled = compiler.compile_grammar(grammar)
        compile_ms = (time.perf_counter() - start) * 1000
        start = time.perf_counter()
        compiler.compile_grammar(grammar)
        cached_ms = (time.perf_counter() - start) * 1000
        per_token = walk(info, compiled, tokens)
        row = {
            "vocabulary": name,
            "vocab_size": info.vocab_size,
            "tools": 8,
            "bounded_strings": bounded,
            "tokenizer_info_s": round(info_s, 3),
            "compile_ms": round(compile_ms, 2),
            "compile_cached_ms": round(cached_ms, 3),
            "mask_per_token_us_median": round(statistics.median(per_token) * 1e6, 1),
            "mask_per_token_us_p99": round(sorted(per_token)[int(0.99 * (len(per_token) - 1))] * 1e6, 1),
            "tokens": len(per_token),
        }
        progress(f"engine ({name}): {row}")
        rows.append(row)
    return rows


def walk(info: xgrammar.TokenizerInfo, compiled, tokens: int) -> list[float]:
    """Seconds per token of masking along random allowed tokens (calls of the grammar, one after the
    other): fill_next_token_bitmask and apply_token_bitmask_inplace, as the emulator does."""
    bitmask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
    logits = torch.zeros(1, info.vocab_size)
    rng = random.Random(0)
    per_token: list[float] = []
    while len(per_token) < tokens:
        matcher = xgrammar.GrammarMatcher(compiled)
        while not matcher.is_terminated() and len(per_token) < tokens:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            masked = logits.clone()
            xgrammar.apply_token_bitmask_inplace(masked, bitmask)
            per_token.append(time.perf_counter() - start)
            allowed = torch.nonzero(masked[0] > float("-inf")).flatten().tolist()
            # Mostly the grammar's way forward; end when the stop token is allowed, one time in four.
            stop = [t for t in allowed if t in info.stop_token_ids]
            token = stop[0] if stop and rng.random() < 0.25 else rng.choice(allowed)
            assert matcher.accept_token(token)
    return per_token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=300)
    parser.add_argument("--tokens", type=int, default=1000)
    args = parser.parse_args()
    proxy = proxy_side(args.repeat)
    engines = [
        *engine_side("test tokenizer", str(tokenizer_dir()), args.tokens),
        *engine_side("Qwen (qwen25 family)", str(FAMILIES["qwen25"].build_cached()), args.tokens),
    ]
    save_result("tool_choice", {"proxy": proxy, "engine": engines})


if __name__ == "__main__":
    main()
