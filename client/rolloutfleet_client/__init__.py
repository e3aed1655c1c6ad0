"""Rollout-worker client for a RolloutFleet: sessions spread across the fleet's proxies, every turn
pinned to the proxy that holds its session, and ride-through when that proxy is restarted.

    from rolloutfleet_client import FleetClient

    async with FleetClient.from_fleet_status(fleet["status"], admin_key) as fleet_client:
        session = await fleet_client.create_session({"task": "gsm8k-17"})
        reply = await fleet_client.chat(session, messages, max_tokens=256)
        await fleet_client.reward(session, 1.0)
        await fleet_client.finish(session)

See `fleet_client` for the API and `retry` for the ride-through rules.
"""

from .errors import (
    FleetClientError,
    NoProxyAvailable,
    OwnerUnavailable,
    ProxyRequestError,
    SessionEnded,
    SessionError,
    SessionLost,
    TurnOutcomeUnknown,
)
from .fleet_client import FleetClient, Session, turn_ids
from .retry import Backoff

__all__ = [
    "Backoff",
    "FleetClient",
    "FleetClientError",
    "NoProxyAvailable",
    "OwnerUnavailable",
    "ProxyRequestError",
    "Session",
    "SessionEnded",
    "SessionError",
    "SessionLost",
    "TurnOutcomeUnknown",
    "turn_ids",
]
