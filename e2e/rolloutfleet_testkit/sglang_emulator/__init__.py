"""SGLang emulator: a TEST STAND-IN for GPU SGLang servers (no GPU exists here).

A tiny seeded torch model (model.py) behind SGLang's HTTP protocol (server.py), with SGLang's request
rules (protocol.py), continuous batching, pause modes, aborts and weight updates (scheduler.py) and a
finite prefix cache that reports `cached_tokens` (radix_cache.py) and images expanded as SGLang's
Qwen-VL processor does (multimodal.py), each following SGLang's source.
"""

from rolloutfleet_testkit.sglang_emulator.model import TinyCausalLM, generate, load_model, score

__all__ = ["TinyCausalLM", "generate", "load_model", "score"]
