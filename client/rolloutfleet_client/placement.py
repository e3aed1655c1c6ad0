"""Choosing the proxy a new session starts on (pure: no I/O, randomness passed in).

Two policies:

- ``least_loaded`` (the default): the endpoint with the fewest *live* sessions by this client's own
  count (sessions it created there and has not finished, deleted or lost), ties broken at random.
  With one client per rollout worker this spreads each worker's sessions evenly; it does not see
  other workers' sessions, which is what random tie-breaking is for.
- ``random``: any endpoint, uniformly.

Endpoints that already refused this creation (draining, memory pressure, over capacity) are
excluded for the rest of that round.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping, Sequence

LEAST_LOADED = "least_loaded"
RANDOM = "random"
POLICIES = (LEAST_LOADED, RANDOM)


def choose_endpoint(
    endpoints: Sequence[str],
    live: Mapping[str, int],
    policy: str,
    rng: random.Random,
    exclude: Collection[str] = (),
) -> str:
    """The endpoint for a new session. Raises ValueError for an unknown policy or when every
    endpoint is excluded."""
    if policy not in POLICIES:
        raise ValueError(f"unknown placement policy {policy!r}; use one of {', '.join(POLICIES)}")
    candidates = [e for e in endpoints if e not in exclude]
    if not candidates:
        raise ValueError("no endpoint left to place a session on")
    if policy == RANDOM:
        return rng.choice(candidates)
    fewest = min(live.get(e, 0) for e in candidates)
    return rng.choice([e for e in candidates if live.get(e, 0) == fewest])
