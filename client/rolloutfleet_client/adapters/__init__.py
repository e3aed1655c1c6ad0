"""Adapters that plug a fleet into the RL frameworks people train with (docs/frameworks.md).

`episode` is what they share: run the user's agent in a fleet session (it gets a base URL and any
API key, as frameworks hand their agents) and take the finished session's trajectory as an
`Episode`: prompt ids, response ids, the response's loss mask, logprobs and weight versions. Each
framework's module turns an `Episode` into that framework's own structure.
"""

from .episode import (
    AgentRun,
    Episode,
    EpisodeImage,
    FleetConfig,
    episode_from_sample,
    fleet_for_this_loop,
    run_episode,
)

__all__ = [
    "AgentRun",
    "Episode",
    "EpisodeImage",
    "FleetConfig",
    "episode_from_sample",
    "fleet_for_this_loop",
    "run_episode",
]
