"""Small httpx connection pools: the CPU a request costs must not grow with the number of sessions.

httpx's pool (httpcore 1.0) walks every connection it holds on every request start and end, asks
each idle one whether its socket is readable, and for each idle one counts all connections again.
With one pool holding a connection per concurrent session, that bookkeeping dominates: 256
concurrent callers against the upstream stand-in cost 4.6 ms of client CPU per request with 64
connections per pool, 2.1 ms with 16, and 1.06 ms with 2, which is httpx's own floor on this
machine (cProfile: `_assign_requests_to_connections`, `has_expired`). So requests go through many
small clients: per target (a proxy URL), `httpx.AsyncClient`s that each carry at most `shard_size`
requests at a time, and so hold at most that many connections. A request takes the client that
most recently had room (its connections are warm); a new client is opened when none has room. All
share one TLS context (creating one per client costs about 30 ms); a client costs about 4 KB.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

SHARD_SIZE = 2


@dataclass(eq=False)
class _Shard:
    client: httpx.AsyncClient
    in_flight: int = 0


class ShardedAsyncClient:
    """`request(target, method, url, ...)`: like `httpx.AsyncClient.request`, through a small pool
    for `target` (the base URL the request goes to)."""

    def __init__(self, *, shard_size: int = SHARD_SIZE, **client_options: Any) -> None:
        if shard_size < 1:
            raise ValueError("shard_size must be at least 1")
        self._shard_size = shard_size
        self._verify: Any = client_options.pop("verify", None)  # None: one default TLS context, made once
        self._options = client_options
        self._free: dict[str, list[_Shard]] = {}  # per target, clients with room for a request
        self._all: list[_Shard] = []

    def _lease(self, target: str) -> _Shard:
        free = self._free.setdefault(target, [])
        if free:
            shard = free[-1]
        else:
            if self._verify is None:
                self._verify = httpx.create_ssl_context()
            client = httpx.AsyncClient(
                verify=self._verify,
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=self._shard_size),
                **self._options,
            )
            shard = _Shard(client)
            self._all.append(shard)
            free.append(shard)
        shard.in_flight += 1
        if shard.in_flight >= self._shard_size:
            free.pop()
        return shard

    def _give_back(self, target: str, shard: _Shard) -> None:
        shard.in_flight -= 1
        if shard.in_flight == self._shard_size - 1:
            self._free.setdefault(target, []).append(shard)

    async def request(self, target: str, method: str, url: str, **kwargs: Any) -> httpx.Response:
        shard = self._lease(target)
        try:
            return await shard.client.request(method, url, **kwargs)
        finally:
            self._give_back(target, shard)

    @property
    def clients(self) -> int:
        """How many clients (small pools) were opened."""
        return len(self._all)

    async def aclose(self) -> None:
        shards, self._all, self._free = self._all, [], {}
        for shard in shards:
            await shard.client.aclose()


class SingleAsyncClient:
    """The same interface over one caller-provided `httpx.AsyncClient` (not closed here)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self._client = client

    async def request(self, target: str, method: str, url: str, **kwargs: Any) -> httpx.Response:
        return await self._client.request(method, url, **kwargs)

    @property
    def clients(self) -> int:
        return 1

    async def aclose(self) -> None:
        return None
