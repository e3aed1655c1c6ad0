"""verl: an agent loop (verl 0.9.1's `verl.experimental.agent_loop`) that runs the user's agent in a
fleet session and hands verl the session's recorded tokens as its `AgentLoopOutput`.

verl finds agent loops in the YAML file named by `actor_rollout_ref.rollout.agent.agent_loop_config_path`
and builds them with `hydra.utils.instantiate`, its other keys becoming constructor arguments; a dataset
row's `agent_name` picks one (docs/frameworks.md). Either in that file:

    - name: rolloutfleet
      _target_: rolloutfleet_client.adapters.verl.FleetAgentLoop
      agent: my_project.agents:solve

or in code, with verl's registry:

    @register("my_agent")
    class MyAgentLoop(FleetAgentLoop):
        agent = staticmethod(solve)

`agent` is the user's coroutine function, unchanged but for its signature:

    async def solve(run: AgentRun, sampling_params: dict, **row) -> float | None:
        client = AsyncOpenAI(base_url=run.base_url, api_key=run.api_key)
        ...  # row: the dataset row verl hands agent loops (raw_prompt, extra_info, tools_kwargs, ...)

Its reward, if any, becomes `reward_score` (None leaves it to verl's reward loop). The fleet is found
from the environment (`FleetConfig.from_env`). The response is cut at `rollout.response_length`, as
verl's own loops cut theirs. This module imports verl: it is importable only where verl is installed.

Weight updates: verl's checkpoint engine aborts every SGLang replica (`pause_generation` in abort mode),
transfers the weights and resumes (`continue_generation`); it offers no hook around that, so the proxies
are not paused: each aborted turn is continued by its proxy once the engine answers again, its tokens
kept, those after the update scored by the new weights. verl sends SGLang no weight version, and its
`AgentLoopOutput` has no per-token versions; the session's are in `extra_fields["weight_versions"]`.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Callable, Mapping
from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput

from .episode import Agent, AgentRun, Episode, FleetConfig, fleet_for_this_loop, run_episode

VerlAgent = Callable[..., Any]  # async (run: AgentRun, sampling_params: dict, **row) -> float | None


def load_agent(agent: str | VerlAgent) -> VerlAgent:
    """The agent named `module.path:function` (or `module.path.function`), or `agent` itself."""
    if not isinstance(agent, str):
        return agent
    module, sep, name = agent.partition(":") if ":" in agent else agent.rpartition(".")
    if not sep or not module or not name:
        raise ValueError(f"agent {agent!r}: expected module.path:function")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


def session_metadata(row: Mapping[str, Any]) -> dict[str, Any]:
    """What of a dataset row names the task in the session's metadata (the proxy's dumps and exports):
    JSON-safe scalars only (verl's rows hold numpy values)."""
    metadata: dict[str, Any] = {"framework": "verl"}
    for key in ("index", "data_source", "agent_name", "uid"):
        value: Any = row.get(key)
        value = value.item() if hasattr(value, "item") else value
        if isinstance(value, str | int | float | bool):
            metadata[key] = value
    return metadata


def agent_loop_output(
    episode: Episode, response_length: int, prompt_length: int, images: list[Any] | None = None
) -> AgentLoopOutput:
    """`episode` as verl's `AgentLoopOutput`, the response cut at `response_length` as verl's own loops
    cut theirs (tool_agent_loop, single_turn_agent_loop). A prompt longer than `prompt_length` is an
    error: verl's loops left-truncate theirs before generating, but this one was generated from.
    `images` (the episode's, decoded: `Episode.pil_images`) become `multi_modal_data["images"]`, from
    which verl's processor makes `pixel_values` and the M-RoPE positions as for its own loops."""
    if len(episode.prompt_ids) > prompt_length:
        raise ValueError(
            f"session {episode.session_id}: its prompt of {len(episode.prompt_ids)} tokens exceeds "
            f"rollout.prompt_length={prompt_length} (verl pads prompts to it); raise prompt_length"
        )
    return AgentLoopOutput(
        prompt_ids=episode.prompt_ids,
        response_ids=episode.response_ids[:response_length],
        response_mask=episode.response_mask[:response_length],
        response_logprobs=episode.response_logprobs[:response_length],
        reward_score=episode.reward,
        multi_modal_data={"images": images} if images else None,
        # Counted as verl's tool loop counts: the first user message, each generation, and each
        # round of tool results or user messages between two generations.
        num_turns=2 * episode.num_turns,
        metrics={},
        extra_fields={
            # The keys verl's own loops always set (its batch expects one schema), then the session's.
            "turn_scores": [],
            "tool_rewards": [],
            "session_id": episode.session_id,
            "turn_finishes": episode.finishes,
            "truncated": episode.truncated or len(episode.response_ids) > response_length,
            "weight_versions": episode.weight_versions,
        },
    )


class FleetAgentLoop(AgentLoopBase):  # type: ignore[misc]
    """verl's agent loop for a fleet: `agent` (a `module:function` name, or the function; else the
    class's `agent`, for subclasses registered with verl's `@register(name)`) runs in a new session.
    verl's own constructor arguments go to `AgentLoopBase`. `fleet`: where the fleet is, else the
    environment (`FleetConfig.from_env`)."""

    agent: VerlAgent | None = None

    def __init__(
        self,
        *args: Any,
        agent: str | VerlAgent | None = None,
        fleet: FleetConfig | None = None,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        chosen = agent if agent is not None else type(self).agent
        if chosen is None:
            raise TypeError("FleetAgentLoop needs an agent: `agent: module.path:function` in its config")
        self.user_agent = load_agent(chosen)
        self.fleet_config = fleet

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        def with_row(run: AgentRun) -> Any:
            return self.user_agent(run, dict(sampling_params), **kwargs)

        agent: Agent = with_row
        fleet = fleet_for_this_loop(self.fleet_config)
        episode = await run_episode(fleet, agent, session_metadata(kwargs))
        rollout = self.rollout_config
        images = await asyncio.to_thread(episode.pil_images) if episode.images else None
        return agent_loop_output(episode, int(rollout.response_length), int(rollout.prompt_length), images)
