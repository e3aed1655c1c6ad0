"""slime and miles: a generate function that runs the user's agent in a fleet session and fills the
framework's `Sample` from the proxy's record.

slime loads a generate function with `--custom-generate-function-path my_rollout.generate` and
calls `await generate(args, sample, sampling_params)`; miles' newer form is
`await generate(GenerateFnInput) -> GenerateFnOutput`. Both take the agent as miles' agentic
generate does (`--custom-agent-function-path`):

    async def my_agent(base_url, prompt, request_kwargs, metadata, **kwargs) -> float | dict | None

`base_url` is the session's capability URL (any `api_key` works, e.g. "EMPTY"); `request_kwargs`
are the rollout's sampling parameters in chat-completions names (`max_tokens`, `temperature`...).
A number returned is the sample's reward; a dict is merged into `sample.metadata` (for the
framework's reward model), and its `"reward"`, if any, is the reward; None leaves the reward to the
framework. The adapter fills, as slime's own multi-turn generate functions do: `tokens` (prompt and
response), `response_length`, `loss_mask` (1 on generated tokens, 0 on tool results and user turns
between them), `rollout_log_probs` (0.0 off the mask), `weight_versions` (each engine version the
response was generated under, as strings, as SGLang reports them), `response` (decoded with the
tokenizer given, else left as it was), `reward`, `status` (TRUNCATED when the last turn hit its
max tokens, ABORTED when it ended aborted, else COMPLETED), and `session_id`; for a vision-language
model's session also `multimodal_inputs` (the images) and `multimodal_train_inputs` (their
`pixel_values` and `image_grid_thw`, made by transformers' processor from the model directory's
`preprocessor_config.json`, each grid checked against the engine's).

Neither slime nor miles is on PyPI: this module imports nothing of theirs at import time (miles'
`GenerateFnOutput` is imported when `miles_generate`'s function runs), and it is tested against
their documented contract (docs/frameworks.md says how).
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from .episode import AgentRun, Episode, FleetConfig, fleet_for_this_loop, run_episode

# SGLang sampling parameter -> chat-completions name (as miles' build_chat_request_kwargs maps them).
_RENAMED = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "sampling_seed": "seed"}
# What the proxy's chat route reads (proxy/rolloutfleet_proxy/openai_format.parse_chat_request).
_CHAT_SAMPLING = frozenset(
    {
        "max_tokens",
        "min_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "stop",
        "seed",
    }
)

AgentFunction = Callable[..., Awaitable[Any]]


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


def request_kwargs(sampling_params: Mapping[str, Any]) -> dict[str, Any]:
    """The rollout's SGLang sampling parameters as chat-completions request fields."""
    renamed: dict[str, Any] = {}
    for name, value in sampling_params.items():
        target = _RENAMED.get(name, name)
        if target in _CHAT_SAMPLING and value is not None and target not in renamed:
            renamed[target] = value
    return renamed


def reward_of(outcome: Any) -> float | None:
    """The reward in what an agent returned: a number, or a dict's `"reward"` number."""
    if isinstance(outcome, Mapping):
        outcome = outcome.get("reward")
    if isinstance(outcome, int | float) and not isinstance(outcome, bool):
        return float(outcome)
    return None


def fill_sample(sample: Any, episode: Episode, outcome: Any, response: str | None) -> Any:
    """Write `episode` (and what the agent returned) into a slime/miles `Sample`, in place."""
    sample.tokens = episode.tokens
    sample.response_length = len(episode.response_ids)
    sample.loss_mask = list(episode.response_mask)
    sample.rollout_log_probs = list(episode.response_logprobs)
    sample.weight_versions = [str(v) for v in episode.weight_versions]
    if response is not None:
        sample.response = response
    if isinstance(outcome, Mapping):
        sample.metadata = {**(sample.metadata or {}), **outcome}
    if episode.reward is not None:
        sample.reward = episode.reward
    status = type(sample).Status
    sample.status = (
        status.TRUNCATED if episode.truncated else status.ABORTED if episode.aborted else status.COMPLETED
    )
    sample.session_id = episode.session_id
    return sample


def multimodal_fields(episode: Episode) -> dict[str, Any]:
    """A vision-language episode's slime/miles multimodal fields, as slime's own VLM rollouts fill
    them: `multimodal_inputs` (the raw images, RGB Pillow images in prompt order) and
    `multimodal_train_inputs` (the processor's `pixel_values` and `image_grid_thw`, what the
    trainer feeds the model; slime drops a sample's images from training without them). {} without
    images. Blocking CPU work (decoding, the processor): run off the loop."""
    if not episode.images:
        return {}
    return {
        "multimodal_inputs": {"images": episode.pil_images()},
        "multimodal_train_inputs": episode.image_inputs(),
    }


async def _run(
    agent: AgentFunction,
    sample: Any,
    sampling_params: Mapping[str, Any],
    config: FleetConfig | None,
    tokenizer: Decoder | None,
) -> Any:
    outcome: Any = None

    async def call(run: AgentRun) -> float | None:
        nonlocal outcome
        outcome = await agent(
            base_url=run.base_url,
            prompt=sample.prompt,
            request_kwargs=request_kwargs(sampling_params),
            metadata=dict(sample.metadata or {}),
        )
        return reward_of(outcome)  # the proxy records it too: the sample and the record agree

    fleet = fleet_for_this_loop(config)
    metadata = {
        "framework_index": getattr(sample, "index", None),
        "group_index": getattr(sample, "group_index", None),
    }
    episode = await run_episode(fleet, call, {k: v for k, v in metadata.items() if v is not None})
    response = None
    if tokenizer is not None:  # CPU work: off the framework's loop
        response = await asyncio.to_thread(tokenizer.decode, episode.response_ids)
    for name, value in (await asyncio.to_thread(multimodal_fields, episode)).items():
        setattr(sample, name, value)
    return fill_sample(sample, episode, outcome, response)


def slime_generate(
    agent: AgentFunction, *, config: FleetConfig | None = None, tokenizer: Decoder | None = None
) -> Callable[[Any, Any, dict[str, Any]], Awaitable[Any]]:
    """slime's custom generate function running `agent`: `generate = slime_generate(my_agent)`."""

    async def generate(args: Any, sample: Any, sampling_params: dict[str, Any]) -> Any:
        return await _run(agent, sample, sampling_params, config, tokenizer)

    return generate


def miles_generate(
    agent: AgentFunction, *, config: FleetConfig | None = None, tokenizer: Decoder | None = None
) -> Callable[[Any], Awaitable[Any]]:
    """miles' generate function (`generate(input: GenerateFnInput) -> GenerateFnOutput`) running
    `agent` on a copy of the input's sample."""

    async def generate(input: Any) -> Any:
        from miles.rollout.base_types import GenerateFnOutput  # type: ignore[import-not-found]  # not on PyPI

        sample = copy.deepcopy(input.sample)
        return GenerateFnOutput(samples=[await _run(agent, sample, input.sampling_params, config, tokenizer)])

    return generate
