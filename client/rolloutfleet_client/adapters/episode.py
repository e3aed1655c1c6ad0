"""One agent episode in a fleet session, taken back as the token-level record trainers consume.

    episode = await run_episode(fleet, agent, metadata={"task": "gsm8k-17"})

`agent` is the user's code, unchanged: it is handed an `AgentRun` (the session's capability URL as
`base_url` and `api_key="EMPTY"`, what frameworks give their agents) and talks to it with any
OpenAI or Anthropic client; it returns the episode's reward (or None, the reward being set later or
by the framework). The session is then finished and taken (exported as a batch of this session
alone, written to the proxy's dump volume before it answers, and acknowledged), and its one sample
(the path to its latest turn) becomes an `Episode`.

An agent that raises leaves its session as it was (live, not deleted): nothing it recorded is
dropped, the proxy's stale-session cleanup writes it to its dump volume before it lets it go, and
the error propagates to the framework, which decides what a failed episode is.
"""

from __future__ import annotations

import asyncio
import os
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..fleet_client import FleetClient

# Finish names in an export's `turn_finishes` (rolloutfleet_wire.session_record.FINISH_NAMES).
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"
# What an agent given a capability URL passes as its key: any value works; frameworks use this one.
ANY_API_KEY = "EMPTY"


@dataclass(frozen=True)
class AgentRun:
    """What the user's agent is given: a base URL that opens its session with any or no API key.
    `base_url` carries the session's secret: do not log it."""

    base_url: str = field(repr=False)
    session_id: str
    api_key: str = ANY_API_KEY


@dataclass(frozen=True)
class EpisodeImage:
    """One image of a vision-language episode, in prompt order: the bytes the agent sent, their
    sha256, the (t, h, w) grid the engine's processor made, and its run of image tokens in
    `Episode.tokens` (`offset`, `tokens` long)."""

    data: bytes = field(repr=False)
    sha256: str
    grid_thw: tuple[int, int, int]
    offset: int
    tokens: int


@dataclass(frozen=True)
class Episode:
    """A finished session's latest path as a framework wants it. `prompt_ids` are the tokens before
    the first generated one; `response_ids` everything after it: generated tokens and the tool
    results and user turns rendered between them, which `response_mask` marks 0 (not trained).
    `response_logprobs` and `versions` are per response token (0.0 and -1 where the mask is 0)."""

    session_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float]
    versions: list[int]
    reward: float | None
    num_turns: int
    finishes: list[str]  # per turn: stop, length, abort or unknown
    metadata: dict[str, Any]
    images: tuple[EpisodeImage, ...] = ()
    # A vision-language model's `preprocessor_config.json`, as the engine's model directory has it.
    processor_config: dict[str, Any] | None = None

    @property
    def truncated(self) -> bool:
        """The last turn was cut at its max tokens (frameworks mark such a sample truncated)."""
        return bool(self.finishes) and self.finishes[-1] == FINISH_LENGTH

    @property
    def aborted(self) -> bool:
        return bool(self.finishes) and self.finishes[-1] == FINISH_ABORT

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def pil_images(self) -> list[Any]:
        """The images as RGB Pillow images, in prompt order (what frameworks keep as raw images).
        Blocking CPU work: call it off an event loop."""
        import io

        from PIL import Image

        decoded = []
        for image in self.images:
            with Image.open(io.BytesIO(image.data)) as opened:
                decoded.append(opened.convert("RGB"))
        return decoded

    def image_inputs(self, image_processor: Any = None) -> dict[str, Any]:
        """The model's image inputs as the trainer's processor makes them: `pixel_values` and
        `image_grid_thw` torch tensors (see `to_torch`), each image's grid checked against the one
        the engine expanded it by; {} without images. Needs transformers, Pillow and torch (the
        trainer extra); blocking CPU work: call it off an event loop."""
        if not self.images:
            return {}
        import torch

        from ..trainer import check_grid, image_processor_for, process_image

        if image_processor is None:
            if self.processor_config is None:
                raise ValueError(f"session {self.session_id} has images but no processor configuration")
            image_processor = image_processor_for(self.processor_config)
        values, grids = [], []
        for k, image in enumerate(self.images):
            pixels, grid = process_image(image_processor, image.data)
            check_grid(grid, image.grid_thw, f"session {self.session_id}: image {k}")
            values.append(pixels)
            grids.append(grid)
        return {"pixel_values": torch.cat(values), "image_grid_thw": torch.stack(grids)}

    def image_token_mask(self) -> list[int]:
        """1 on the image tokens of `tokens`, 0 elsewhere (AReaL's `mm_token_type_ids`)."""
        mask = [0] * len(self.tokens)
        for image in self.images:
            mask[image.offset : image.offset + image.tokens] = [1] * image.tokens
        return mask

    @property
    def weight_versions(self) -> list[int]:
        """The versions the turns were generated under, each once, in order (what slime records)."""
        seen = [v for v, m in zip(self.versions, self.response_mask, strict=True) if m]
        return list(dict.fromkeys(seen))


def episode_from_sample(sample: Mapping[str, Any]) -> Episode:
    """An `Episode` from one sample of an export's JSON view (`FleetClient.take`). A session without
    a generated token has an empty response."""
    ids = list(sample["input_ids"])
    bounds = [list(b) for b in sample["turn_bounds"]]
    start = bounds[0][1] if bounds else len(ids)
    return Episode(
        session_id=sample["session_id"],
        prompt_ids=ids[:start],
        response_ids=ids[start:],
        response_mask=list(sample["loss_mask"][start:]),
        response_logprobs=[float(x) for x in sample["logprobs"][start:]],
        versions=list(sample["versions"][start:]),
        reward=sample.get("reward"),
        num_turns=len(bounds),
        finishes=list(sample.get("turn_finishes") or ["unknown"] * len(bounds)),
        metadata=dict(sample.get("metadata") or {}),
        images=tuple(_episode_image(image) for image in sample.get("images") or ()),
        processor_config=(sample.get("vision") or {}).get("processor_config"),
    )


def _episode_image(image: Mapping[str, Any]) -> EpisodeImage:
    if "data" not in image:
        raise ValueError("an image of the sample has no bytes: take samples with FleetClient.take")
    t, h, w = (int(x) for x in image["grid_thw"])
    return EpisodeImage(image["data"], image["sha256"], (t, h, w), int(image["offset"]), int(image["tokens"]))


Agent = Callable[[AgentRun], Awaitable[float | None]]


async def run_episode(fleet: FleetClient, agent: Agent, metadata: Mapping[str, Any] | None = None) -> Episode:
    """Run `agent` in a new session of `fleet`, set the reward it returns, finish and take the
    session: its `Episode`."""
    session = await fleet.create_session(metadata)
    reward = await agent(AgentRun(fleet.agent_base_url(session), session.session_id))
    if reward is not None:
        await fleet.reward(session, float(reward))
    await fleet.finish(session)
    taken = await fleet.take(session)
    return episode_from_sample(taken[0])


@dataclass(frozen=True)
class FleetConfig:
    """Where a framework's rollout workers find the fleet. From the environment by default:
    `ROLLOUTFLEET_ENDPOINTS` (comma-separated proxy URLs, the fleet's `status.proxyEndpoints`) or
    `ROLLOUTFLEET_CLIENT_URL` (its client Service), and `ROLLOUTFLEET_ADMIN_KEY`."""

    admin_key: str = field(repr=False)
    endpoints: Sequence[str] | None = None
    client_url: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> FleetConfig:
        env = os.environ if env is None else env
        key = env.get("ROLLOUTFLEET_ADMIN_KEY")
        endpoints = [u for u in env.get("ROLLOUTFLEET_ENDPOINTS", "").split(",") if u.strip()]
        client_url = env.get("ROLLOUTFLEET_CLIENT_URL") or None
        if not key:
            raise ValueError("set ROLLOUTFLEET_ADMIN_KEY (the fleet's admin key)")
        if bool(endpoints) == bool(client_url):
            raise ValueError("set one of ROLLOUTFLEET_ENDPOINTS (proxy URLs) or ROLLOUTFLEET_CLIENT_URL")
        return cls(key, [u.strip() for u in endpoints] or None, client_url)

    def client(self) -> FleetClient:
        if self.client_url is not None:
            return FleetClient(client_url=self.client_url, admin_key=self.admin_key)
        return FleetClient(self.endpoints, admin_key=self.admin_key)


# One client per event loop: frameworks call their rollout hooks from a loop of their own (slime's
# and verl's run in a background thread's loop), and an httpx client belongs to the loop it was
# first used on.
_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, FleetClient] = weakref.WeakKeyDictionary()


def fleet_for_this_loop(config: FleetConfig | None = None) -> FleetClient:
    """The `FleetClient` of the running event loop, made on first use from `config` (default: the
    environment, `FleetConfig.from_env`)."""
    loop = asyncio.get_running_loop()
    client = _clients.get(loop)
    if client is None:
        client = _clients[loop] = (config or FleetConfig.from_env()).client()
    return client
