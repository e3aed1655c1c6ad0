"""CPU reference engine: a TEST STAND-IN for GPU SGLang servers.

A tiny seeded torch model (model.py) behind the SGLang HTTP protocol subset (server.py).
"""

from rolloutfleet_testkit.refengine.model import TinyCausalLM, generate, load_model, score

__all__ = ["TinyCausalLM", "generate", "load_model", "score"]
