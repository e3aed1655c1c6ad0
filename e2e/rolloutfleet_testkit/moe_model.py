"""A mixture-of-experts model directory for the tests: the test tokenizer's files and a config.json
naming experts the way Qwen3-MoE's does (`num_hidden_layers`, `num_experts_per_tok`, `num_experts`),
which both the SGLang emulator (its model then routes every position: sglang_emulator/model.py) and the
proxy (the shape of the routing it records) read, as SGLang and the proxy read a real model's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def moe_model_dir(
    tokenizer_dir: Path, target: Path, layers: int = 4, top_k: int = 2, experts: int = 16
) -> Path:
    """`target`, made a copy of `tokenizer_dir` with a config.json of `layers` x top-`top_k` of `experts`."""
    target.mkdir(parents=True, exist_ok=True)
    for path in Path(tokenizer_dir).iterdir():
        if path.is_file() and path.name != "config.json":
            shutil.copy2(path, target / path.name)
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_hidden_layers": layers,
        "num_experts_per_tok": top_k,
        "num_experts": experts,
    }
    (target / "config.json").write_text(json.dumps(config))
    return target
