"""A mixture-of-experts model directory: the routing shape routing replay records.

Read from the model directory's `config.json` as SGLang reads it (`ModelConfig.hf_text_config`:
`num_hidden_layers`, `num_experts_per_tok`, and the expert count), so nothing is set by hand and the
proxy's rows have the shape the engines' answers have. A directory without them is refused at start
when routing replay is on: every turn would fail otherwise.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from rolloutfleet_wire.routed_experts import RoutingError, RoutingShape, shape_from_model_config

MODEL_CONFIG = "config.json"


def load_routing_shape(model_dir: str | os.PathLike) -> RoutingShape:
    """The routing shape of the model in `model_dir` (blocking); RoutingError saying what is wrong."""
    path = Path(model_dir) / MODEL_CONFIG
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise RoutingError(f"routing replay needs the model's {path}: {exc}") from None
    if not isinstance(config, dict):
        raise RoutingError(f"{path} is not a JSON object")
    try:
        return shape_from_model_config(config)
    except RoutingError as exc:
        raise RoutingError(f"{path}: {exc}") from None
