"""`FleetClient`: sessions spread across a fleet's proxies, turns pinned to the owner, ride-through.

A fleet runs N proxies, each holding the sessions created on it. A session is created on any proxy
(chosen by this client from the fleet's per-pod endpoints, or by the fleet's client Service), and
the proxy answers with its own stable URL (`proxy_url`, its per-pod DNS name). Every later call
for that session goes to that URL, the session's *owner*. Session ids carry nothing the client
parses.

Ride-through. When the owner is restarted (the operator's memory watchdog deletes the pod; the pod
drains, writes its sessions to its dump directory, and a replacement under the same name restores
them), calls for its sessions wait and go on, with the same request:

- retried while waiting for the owner: connection errors (refused, reset, DNS failure, connect
  timeout), 503 (`draining`: the proxy shuts down and nothing was recorded; `generation_paused`;
  any other 503), 502, and 404 while the owner's `/readyz` is not 200 (a replacement still
  restoring);
- fatal: 404 once the owner is ready (`SessionLost` naming the session: it was not restored, and
  this client never starts a new session in its place; a proxy answers a key that does not open the
  session the same way, and a session lost in a restart answers its own key so too), 410
  (`SessionEnded`), 409 and 400 (a client bug: `ProxyRequestError` with the proxy's message), every
  other 4xx and 5xx, and read timeouts;
- a turn whose connection broke after it was sent is resent with the same `Idempotency-Key` (every
  turn carries one): if the proxy recorded it, it answers from the record (exactly once, across its
  restarts); if it says the turn is still running (409 `session_busy`) the client waits; a proxy
  too old to replay says the turn was recorded (400 `no_new_messages`) and `TurnOutcomeUnknown` is
  raised;
- waits grow exponentially from 0.2 s to at most 5 s (at least the proxy's `Retry-After`), and
  one call waits at most `restart_timeout_s` from its first failure, then raises
  `OwnerUnavailable`. Every wait is logged at info on the `rolloutfleet.client` logger.

A turn retried after a restart resends the same messages: a turn the drain cancelled answered 503
`draining`, with nothing recorded, and the replacement restored the session as it was before it.

Creating a session: 503 `draining` or `memory_pressure`, 429 `over_capacity`, 502/503 and
connection failures move on to another endpoint (placement excluding those that refused); once
every endpoint refused, the client waits (exponential backoff, at least the smallest `Retry-After`
seen; with a single client URL the next try may reach another proxy, so Retry-After is not
applied there) and tries again, for at most `create_timeout_s` (default: `restart_timeout_s`),
then raises `NoProxyAvailable`. The rules as tables: `retry.py`.

Placement (`placement.py`): `least_loaded` (default) picks the endpoint with the fewest live
sessions by this client's count (created, not finished, deleted or lost), ties at random; `random`
picks uniformly. `seed` makes both reproducible.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from rolloutfleet_wire.errors import ErrorCode
from rolloutfleet_wire.export_format import DecodedBatch, decode_batch

from .errors import (
    NoAnswerCode,
    NoProxyAvailable,
    OwnerUnavailable,
    ProxyRequestError,
    SessionEnded,
    SessionLost,
    TurnOutcomeUnknown,
    proxy_error,
)
from .http_pool import ShardedAsyncClient, SingleAsyncClient
from .placement import LEAST_LOADED, POLICIES, choose_endpoint
from .retry import (
    DELETE,
    READ,
    TURN,
    WRITE,
    Action,
    Backoff,
    Verdict,
    classify_create_answer,
    classify_exception,
    classify_session_answer,
    retry_after_s,
)

log = logging.getLogger("rolloutfleet.client")

DEFAULT_MODEL = "rolloutfleet"


IDEMPOTENCY_HEADER = "Idempotency-Key"


def _samples_of(content: bytes) -> tuple[DecodedBatch, list[dict[str, Any]]]:
    """An export's decoded batch and its samples' JSON views, image bytes included."""
    batch = decode_batch(content)
    return batch, [batch.trajectory(i, image_bytes=True) for i in range(batch.num_trajectories)]


def turn_ids(response: Mapping[str, Any]) -> list[int]:
    """The recorded turn of each choice of a chat response (one per choice; `n` > 1: several)."""
    extra = response.get("rolloutfleet") or {}
    return list(extra.get("turns") or [extra["turn"]])


@dataclass(eq=False)
class Session:
    """One session: its id and key, and its owner, the proxy URL every call for it goes to."""

    session_id: str
    session_key: str = field(repr=False)
    owner: str  # the `proxy_url` the proxy returned, else the endpoint the session was created at
    endpoint: str  # the endpoint it was created at (what placement counts)
    metadata: dict[str, Any] = field(default_factory=dict)
    turns: int = 0  # turns completed through this client
    live: bool = True  # not finished, deleted or lost (counted by least-loaded placement)
    capability_url: str | None = field(default=None, repr=False)  # a secret: the URL alone opens it

    @property
    def base_url(self) -> str:
        """The session's OpenAI base URL (`{owner}/v1/sessions/{id}`)."""
        return f"{self.owner}/v1/sessions/{self.session_id}"


class FleetClient:
    """Async client for a fleet of proxies. Give either `endpoints` (the fleet's
    `status.proxyEndpoints`, per-pod URLs: the client places sessions itself) or `client_url` (the
    fleet's client Service: it places them), and the admin key. Use as `async with`, or call
    `aclose()`. `http`: one `httpx.AsyncClient` to send everything through instead of the client's
    own small pools (`http_pool`); it is not closed by this client."""

    def __init__(
        self,
        endpoints: Sequence[str] | None = None,
        *,
        client_url: str | None = None,
        admin_key: str,
        placement: str = LEAST_LOADED,
        restart_timeout_s: float = 300.0,
        create_timeout_s: float | None = None,
        timeout_s: float = 660.0,
        connect_timeout_s: float = 5.0,
        backoff: Backoff | None = None,
        seed: int | None = None,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        if (endpoints is None) == (client_url is None):
            raise ValueError("give either endpoints or client_url")
        urls = [client_url] if client_url is not None else list(endpoints or [])
        if not urls or not all(isinstance(u, str) and u for u in urls):
            raise ValueError("no proxy endpoints")
        if placement not in POLICIES:
            raise ValueError(f"unknown placement policy {placement!r}; use one of {', '.join(POLICIES)}")
        if restart_timeout_s <= 0 or (create_timeout_s is not None and create_timeout_s <= 0):
            raise ValueError("timeouts must be > 0")
        self.endpoints = list(dict.fromkeys(u.rstrip("/") for u in urls))
        self.via_service = client_url is not None
        self.placement = placement
        self.restart_timeout_s = restart_timeout_s
        self.create_timeout_s = create_timeout_s if create_timeout_s is not None else restart_timeout_s
        self._admin_key = admin_key
        self._backoff = backoff or Backoff()
        self._rng = random.Random(seed)  # placement
        self._jitter = random.Random(None if seed is None else seed + 1)  # waits
        self._live: collections.Counter[str] = collections.Counter()
        self._connect_timeout_s = connect_timeout_s
        # Small pools (see http_pool): connections kept alive between turns, CPU per call flat in K.
        self._http: ShardedAsyncClient | SingleAsyncClient = (
            SingleAsyncClient(http)
            if http is not None
            else ShardedAsyncClient(timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s))
        )

    @classmethod
    def from_fleet_status(cls, status: Mapping[str, Any], admin_key: str, **kwargs: Any) -> FleetClient:
        """From a RolloutFleet's `status` (or the whole object): its `proxyEndpoints`, the ready
        proxies' per-pod URLs."""
        if "status" in status and "proxyEndpoints" not in status:
            status = status["status"] or {}
        endpoints = list(status.get("proxyEndpoints") or [])
        if not endpoints:
            raise ValueError("the fleet has no ready proxies yet (status.proxyEndpoints is empty)")
        return cls(endpoints, admin_key=admin_key, **kwargs)

    def update_endpoints(self, endpoints: Sequence[str]) -> None:
        """New endpoints for new sessions (for example from a fresh `status.proxyEndpoints` after the
        fleet was scaled). Existing sessions keep their owners."""
        if self.via_service:
            raise ValueError("this client places sessions through a client URL")
        urls = list(dict.fromkeys(u.rstrip("/") for u in endpoints))
        if not urls:
            raise ValueError("no proxy endpoints")
        self.endpoints = urls

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> FleetClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def live_sessions(self) -> dict[str, int]:
        """Per endpoint, the live sessions this client created there (what least-loaded balances)."""
        return {e: self._live[e] for e in self.endpoints}

    @staticmethod
    def openai_base_url(session: Session) -> str:
        """Base URL for the official `openai` client (with `api_key=session.session_key` and
        `max_retries=0`). Calls made that way do not ride through restarts."""
        return session.base_url

    @staticmethod
    def agent_base_url(session: Session) -> str:
        """The session's capability URL: a base URL that works with any or no API key (what
        frameworks hand their agents: `base_url` and `api_key="EMPTY"`). It carries the session's
        secret: give it only to the agent, do not log it; deleting the session revokes it."""
        if session.capability_url is None:
            raise ValueError("this proxy returned no capability_url (it predates capability URLs)")
        return session.capability_url

    # --- creating ----------------------------------------------------------------------------------

    async def create_session(
        self, metadata: Mapping[str, Any] | None = None, *, session_id: str | None = None
    ) -> Session:
        """Create a session on a proxy chosen by placement (or by the client Service)."""
        body: dict[str, Any] = {}
        if metadata is not None:
            body["metadata"] = dict(metadata)
        if session_id is not None:
            body["session_id"] = session_id
        loop = asyncio.get_running_loop()
        started = loop.time()
        attempt = 0
        refused: dict[str, float | None] = {}  # this round: endpoint -> its Retry-After
        last: dict[str, str] = {}
        while True:
            endpoint = choose_endpoint(self.endpoints, self._live, self.placement, self._rng, refused)
            # Counted from now on, so that concurrent creations see it; given back unless created.
            self._live[endpoint] += 1
            created: Session | None = None
            try:
                verdict, retry_after, created = await self._create_at(endpoint, body)
            finally:
                if created is None:
                    self._live[endpoint] -= 1
            if created is not None:
                return created
            refused[endpoint] = retry_after
            last[endpoint] = verdict.reason
            if len(refused) < len(self.endpoints):
                log.info(
                    "creating a session: %s refused (%s); trying another proxy", endpoint, verdict.reason
                )
                continue
            hints = [r for r in refused.values() if r is not None]
            floor = min(hints) if hints and not self.via_service else None
            elapsed = loop.time() - started
            delay = self._backoff.next_wait(
                attempt, elapsed, self.create_timeout_s, floor, self._jitter.random()
            )
            if delay is None:
                raise NoProxyAvailable(last, elapsed)
            log.info(
                "creating a session: no proxy accepts one (%s); retrying in %.2fs",
                ", ".join(f"{e}: {r}" for e, r in last.items()),
                delay,
            )
            await asyncio.sleep(delay)
            attempt += 1
            refused.clear()

    async def _create_at(
        self, endpoint: str, body: dict[str, Any]
    ) -> tuple[Verdict, float | None, Session | None]:
        """One creation attempt at one endpoint: (verdict, Retry-After, the session if created).
        Raises for fatal answers."""
        url = f"{endpoint}/v1/sessions"
        try:
            response = await self._http.request(
                endpoint, "POST", url, headers=self._auth(self._admin_key), json=body
            )
        except httpx.TransportError as exc:
            verdict = classify_exception(exc, creating=True)
            if verdict.action is Action.FATAL:
                raise ProxyRequestError(url, None, NoAnswerCode.TRANSPORT_ERROR, verdict.reason) from exc
            if verdict.maybe_handled:
                log.warning(
                    "creating a session at %s: %s; if the proxy created it, it stays unused "
                    "until its stale-session timeout",
                    endpoint,
                    verdict.reason,
                )
            return verdict, None, None
        code, message = ("", "") if response.is_success else proxy_error(response)
        verdict = classify_create_answer(response.status_code, code)
        if verdict.action is Action.OK:
            return verdict, None, self._session_of(response.json(), endpoint, body.get("metadata") or {})
        if verdict.action is Action.FATAL:
            raise ProxyRequestError(url, response.status_code, code, message)
        return verdict, retry_after_s(response.headers.get("retry-after")), None

    def _session_of(self, created: Mapping[str, Any], endpoint: str, metadata: dict[str, Any]) -> Session:
        owner = created.get("proxy_url")
        if not owner:
            owner = endpoint
            if self.via_service:
                log.warning(
                    "the proxy returned no proxy_url (no public_url set): turns of session %s go to the "
                    "client URL %s and may reach another proxy",
                    created["session_id"],
                    endpoint,
                )
        owner = str(owner).rstrip("/")
        capability = created.get("capability_url")
        if capability is not None and not capability.startswith(("http://", "https://")):
            capability = owner + capability  # relative: the proxy knows no public URL of its own
        return Session(
            session_id=created["session_id"],
            session_key=created["session_key"],
            owner=owner,
            endpoint=endpoint,
            metadata=metadata,
            capability_url=capability,
        )

    def _release(self, session: Session) -> None:
        if session.live:
            session.live = False
            self._live[session.endpoint] -= 1

    # --- session calls --------------------------------------------------------------------------

    async def chat(
        self,
        session: Session,
        messages: Sequence[Mapping[str, Any]],
        n: int = 1,
        regenerate: bool = False,
        **params: Any,
    ) -> dict:
        """One turn: POST {owner}/v1/sessions/{id}/chat/completions. Send the whole conversation of
        the branch you continue, with earlier replies exactly as returned (tool calls included;
        `reasoning_content` may be kept or dropped): a history that leaves the latest branch (a
        compaction, a return to an earlier turn, a sub-agent) starts a branch where it differs.
        `n` > 1 samples n replies of the same prompt (a GRPO group), one branch each; `regenerate`
        asks for a new sample of a request answered before (otherwise it is answered again from the
        record). `params` are the request's other fields: `max_tokens`, `temperature`, ...,
        `tools`, `tool_choice`, `chat_template_kwargs` (e.g. {"enable_thinking": False}).

        Returns the OpenAI-style response dict; its messages carry `tool_calls` and
        `reasoning_content` when the proxy's parsers found them, and `turn_ids(response)` gives the
        recorded turn of each choice (for per-turn rewards)."""
        if params.get("stream"):
            raise ValueError("chat() does not stream; use openai_base_url() with the openai client for that")
        body = {"model": params.pop("model", DEFAULT_MODEL), "messages": list(messages), **params}
        if n != 1:
            body["n"] = n
        if regenerate:
            body["regenerate"] = True
        # One key per turn, the same on every resend: the proxy answers a resend from its record.
        headers = {IDEMPOTENCY_HEADER: secrets.token_urlsafe(16)}
        response = await self._session_call(
            session, "POST", "/chat/completions", TURN, json=body, extra_headers=headers
        )
        session.turns += 1
        return response.json()

    async def reward(self, session: Session, reward: float, turn: int | None = None) -> dict:
        """Set the session's reward, or one turn's. Returns the session summary."""
        body: dict[str, Any] = {"reward": reward}
        if turn is not None:
            body["turn"] = turn
        return (await self._session_call(session, "POST", "/reward", WRITE, json=body)).json()

    async def finish(self, session: Session) -> dict:
        """No more turns: the session becomes a ready trajectory. Returns the summary."""
        summary = (await self._session_call(session, "POST", "/finish", WRITE)).json()
        self._release(session)
        return summary

    async def take(
        self, session: Session, *, samples: str = "latest", drop_replaced: bool = False
    ) -> list[dict[str, Any]]:
        """A finished session's trajectory, taken from its owner in one call, for frameworks that
        consume one episode at a time: exported as a batch of this session alone (the proxy writes it
        to its dump volume before it answers, as every export) and acknowledged once decoded here.
        Returns its samples (one, the path to the latest turn, by default; per leaf or per turn with
        `samples`, as `TrainerClient.export_from`), each the export's JSON view: `input_ids`,
        `loss_mask`, `logprobs`, `versions`, `reward`, `turn_bounds`, ..., and `sample` (its place
        in the tree); a vision-language session's `images` (in prompt order, each with its `data`:
        the bytes the agent sent) and `vision` (the processor configuration). If the answer is
        lost, the batch stays held on the proxy until its TTL, and `TrainerClient.pending()` finds
        it."""
        owner, sid = session.owner, session.session_id
        admin = self._auth(self._admin_key)
        body: dict[str, Any] = {"session_ids": [sid], "samples": samples, "drop_replaced": drop_replaced}
        exported = await self._http.request(owner, "POST", f"{owner}/v1/exports", headers=admin, json=body)
        if exported.status_code != 201:
            code, message = proxy_error(exported)
            raise ProxyRequestError(f"{owner}/v1/exports", exported.status_code, code, message, sid)
        batch, taken = await asyncio.to_thread(_samples_of, exported.content)  # CPU: off the caller's loop
        ack_url = f"{owner}/v1/exports/{batch.batch_id}/ack"
        acknowledged = await self._http.request(owner, "POST", ack_url, headers=admin)
        if acknowledged.status_code != 200:
            code, message = proxy_error(acknowledged)
            raise ProxyRequestError(ack_url, acknowledged.status_code, code, message, sid)
        self._release(session)
        return taken

    async def get(self, session: Session, tokens: bool = True) -> dict:
        """The session summary; with `tokens`, its trajectory (ids, loss mask, logprobs, turns)."""
        params = {"tokens": "true" if tokens else "false"}
        return (await self._session_call(session, "GET", "", READ, params=params)).json()

    async def delete(self, session: Session) -> None:
        """Remove the session from its proxy (nothing is kept)."""
        await self._session_call(session, "DELETE", "", DELETE)
        self._release(session)

    @staticmethod
    def _auth(key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}

    async def _owner_ready(self, owner: str) -> bool:
        try:
            response = await self._http.request(
                owner, "GET", f"{owner}/readyz", timeout=self._connect_timeout_s
            )
        except httpx.TransportError:
            return False
        return response.status_code == 200

    async def _session_call(
        self,
        session: Session,
        method: str,
        suffix: str,
        call: str,
        extra_headers: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        """Send a session call to the owner, riding through its restart (rules: module docstring)."""
        sid, owner = session.session_id, session.owner
        url = f"{owner}/v1/sessions/{sid}{suffix}"
        headers = {**self._auth(session.session_key), **(extra_headers or {})}
        loop = asyncio.get_running_loop()
        first_failure: float | None = None
        attempt = 0
        maybe_handled = False
        while True:
            retry_after = None
            try:
                response = await self._http.request(owner, method, url, headers=headers, **kwargs)
            except httpx.TransportError as exc:
                verdict = classify_exception(exc)
                if verdict.action is Action.FATAL:
                    raise ProxyRequestError(
                        url, None, NoAnswerCode.TRANSPORT_ERROR, verdict.reason, sid
                    ) from exc
                maybe_handled = maybe_handled or verdict.maybe_handled
            else:
                code, message = ("", "") if response.is_success else proxy_error(response)
                verdict = classify_session_answer(
                    response.status_code, code, call=call, maybe_handled=maybe_handled
                )
                if verdict.action is Action.OK:
                    return response
                if verdict.action is Action.CHECK_READY:
                    if await self._owner_ready(owner):
                        self._release(session)
                        raise SessionLost(sid, owner, f"{response.status_code} {code}: {message}")
                    verdict = Verdict(Action.WAIT, f"{verdict.reason} while the owner is not ready")
                elif verdict.action is Action.TURN_RECORDED:
                    raise TurnOutcomeUnknown(
                        sid,
                        owner,
                        "the connection broke after the turn was sent and the proxy recorded it; "
                        f"its reply is lost ({message})",
                    )
                elif verdict.action is Action.FATAL:
                    if response.status_code == 410:
                        self._release(session)
                        # Journaled, but its owner could not rebuild it. Older proxies tell the session
                        # key so; newer ones tell only the admin key and answer it 404 (handled above).
                        if code == ErrorCode.SESSION_LOST:
                            raise SessionLost(sid, owner, f"410 {code}: {message}")
                        raise SessionEnded(sid, owner, code, message)
                    raise ProxyRequestError(url, response.status_code, code, message, sid)
                retry_after = retry_after_s(response.headers.get("retry-after"))
            now = loop.time()
            if first_failure is None:
                first_failure = now
            delay = self._backoff.next_wait(
                attempt, now - first_failure, self.restart_timeout_s, retry_after, self._jitter.random()
            )
            if delay is None:
                raise OwnerUnavailable(
                    sid, owner, f"not back within {self.restart_timeout_s:g}s (last: {verdict.reason})"
                )
            log.info(
                "session %s: owner %s unavailable (%s); retrying in %.2fs", sid, owner, verdict.reason, delay
            )
            await asyncio.sleep(delay)
            attempt += 1
