"""AReaL: a `RolloutWorkflow` (AReaL 1.0.4's `areal.api.workflow_api`) that runs the user's agent in a
fleet session and returns the session's recorded tokens as AReaL's trajectory, a dict of `[1, T]`
tensors built as AReaL's own workflows build theirs (`areal/workflow/rlvr.py`, `multi_turn.py`):
`input_ids`, `loss_mask`, `logprobs`, `versions`, `attention_mask` and `rewards` (`[1]`).

    workflow = FleetWorkflow(MathAgent())           # any object with `async run(data, **extra_kwargs)`
    trainer.train(workflow=workflow, ...)            # or rollout.submit / rollout_batch(workflow=...)

The agent is AReaL's kind, unchanged: `run(data, base_url=..., api_key=..., http_client=...)` gets
the session's capability URL and `"EMPTY"` (any key opens it), and returns its reward as a float (or
None: the trajectory's reward is then 0.0). AReaL's per-completion rewards (a dict keyed by response
id) are refused: reward the session as a whole. The fleet is found from the environment
(`FleetConfig.from_env`). This module imports AReaL's workflow API and torch.

Weight updates: AReaL pauses SGLang itself (`/pause_generation`, which aborts running requests),
updates the weights (`/update_weights_from_disk` or over NCCL) and continues (`/continue_generation`);
the proxies ride through, continuing each aborted turn. AReaL sends SGLang no weight version: the
versions a proxy records are then its own model version, which the trainer sets on every proxy
(`TrainerClient.set_model_version`) where it sets AReaL's (`rollout.set_version`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import httpx
import torch
from areal.api.workflow_api import RolloutWorkflow

from .episode import AgentRun, Episode, FleetConfig, fleet_for_this_loop, run_episode


def trajectory(episode: Episode, image_inputs: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """`episode` as AReaL's trajectory: `[1, T]` tensors of the whole sequence (prompt and response),
    with the dtypes AReaL's workflows use; prompt tokens are masked out with logprob 0.0 and version
    -1, as AReaL's own workflows mark them. A vision-language episode's `image_inputs`
    (`Episode.image_inputs()`) go in as AReaL's vision workflow puts its own: `multi_modal_input`
    (`pixel_values`, `image_grid_thw`) and `mm_token_type_ids` (1 on image tokens)."""
    prompt = len(episode.prompt_ids)
    sequence = {
        "input_ids": torch.tensor(episode.tokens, dtype=torch.int32),
        "loss_mask": torch.tensor([0] * prompt + episode.response_mask, dtype=torch.int32),
        "logprobs": torch.tensor([0.0] * prompt + episode.response_logprobs, dtype=torch.float32),
        "versions": torch.tensor([-1] * prompt + episode.versions, dtype=torch.int32),
        "attention_mask": torch.ones(prompt + len(episode.response_ids), dtype=torch.bool),
        "rewards": torch.tensor(episode.reward or 0.0, dtype=torch.float32),
    }
    if image_inputs:
        sequence["mm_token_type_ids"] = torch.tensor(episode.image_token_mask(), dtype=torch.long)
    out: dict[str, Any] = {name: tensor.unsqueeze(0) for name, tensor in sequence.items()}
    if image_inputs:
        out["multi_modal_input"] = [dict(image_inputs)]
    return out


class FleetWorkflow(RolloutWorkflow):  # type: ignore[misc]
    """AReaL's workflow for a fleet: each episode runs `agent` in a new session. `fleet`: where the
    fleet is, else the environment. `http_client`: handed to the agent as AReaL hands its own (None:
    the agent's client makes its own). `engine` (AReaL's inference engine) is not called: the
    agent's requests go through the fleet."""

    def __init__(
        self, agent: Any, fleet: FleetConfig | None = None, http_client: httpx.AsyncClient | None = None
    ):
        self.agent = agent
        self.fleet_config = fleet
        self.http_client = http_client

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, Any]:
        async def agent(run: AgentRun) -> float | None:
            reward = await self.agent.run(
                data, base_url=run.base_url, api_key=run.api_key, http_client=self.http_client
            )
            if isinstance(reward, Mapping):
                raise TypeError("per-completion rewards (a dict) are not supported: return one float")
            return None if reward is None else float(reward)

        episode = await run_episode(fleet_for_this_loop(self.fleet_config), agent, session_metadata(data))
        image_inputs = await asyncio.to_thread(episode.image_inputs) if episode.images else None
        return trajectory(episode, image_inputs)


def session_metadata(data: Mapping[str, Any]) -> dict[str, Any]:
    """What of AReaL's data item names the task in the session's metadata: JSON-safe scalars only."""
    metadata: dict[str, Any] = {"framework": "areal"}
    for key in ("query_id", "id", "index"):
        value = data.get(key)
        if isinstance(value, str | int | float | bool):
            metadata[key] = value
    return metadata
