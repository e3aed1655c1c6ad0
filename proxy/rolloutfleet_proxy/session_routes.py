"""Session routes: create and list sessions (admin key), read, reward, finish and delete one (its
own key). The turns themselves are in turn_routes.py."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import orjson
from fastapi import APIRouter, Request
from rolloutfleet_wire.errors import ErrorCode
from starlette.responses import Response

from .admission import CONCURRENCY_RETRY_AFTER_S, STALENESS_RETRY_AFTER_S, limiting_bound
from .errors import (
    bad_request,
    draining,
    invalid_session_id,
    not_a_json_object,
    too_many,
    unavailable,
)
from .failures import DeletionNotDurable, Failure, TurnInFlight
from .history import MAX_JSON_DEPTH, json_depth_within
from .ids import capability_path, is_valid_new_session_id, key_digest, new_session_id, new_session_key
from .lifecycle import CancelCause
from .openai_format import json_body
from .responses import json_response
from .route_auth import RouteAuth
from .runtime import ProxyRuntime
from .session import Session
from .settings import ProxySettings
from .stats import recent_rss_bytes

# Exports hold rewards as float32: anything larger would become inf there.
MAX_REWARD = float(np.finfo(np.float32).max)


def session_router(runtime: ProxyRuntime, settings: ProxySettings, auth: RouteAuth) -> APIRouter:
    router = APIRouter()
    require_admin, authorized_session = auth.require_admin, auth.authorized_session

    async def read_json(request: Request) -> Any:
        return json_body(await request.body())

    def refuse_over_capacity() -> None:
        """429 when admission has no room for one more session (see admission.py)."""
        version = runtime.generation.model_version
        bound = limiting_bound(runtime.limits, version, runtime.admission.accepted, runtime.store.running)
        if bound is None:
            return
        runtime.admission.refused += 1
        limits, running = runtime.limits, runtime.store.running
        if bound == "concurrency":
            message = f"{running} sessions are running, the most this proxy admits (max_concurrent_sessions)"
            retry_after = CONCURRENCY_RETRY_AFTER_S
        else:
            message = (
                f"admitting another session could exceed the off-policy bound: {runtime.admission.accepted} "
                f"accepted + {running} running sessions reach (max_staleness {limits.max_staleness} + "
                f"model version {version} + 1) x batch share {limits.batch_share}; "
                "capacity returns when the trainer publishes a new model version"
            )
            retry_after = STALENESS_RETRY_AFTER_S
        raise too_many(ErrorCode.OVER_CAPACITY, message, retry_after)

    @router.post("/v1/sessions", status_code=201)
    async def create_session(request: Request) -> Response:
        require_admin(request)
        raw = await request.body()
        body = json_body(raw) if raw.strip() else {}
        if not isinstance(body, dict):
            raise not_a_json_object()
        if not runtime.lifecycle.serving:  # starting or draining
            raise draining("this proxy is not taking new sessions; use another one")
        session_id = body.get("session_id")
        session_id = new_session_id() if session_id is None else session_id  # "", 0, false are errors
        if not isinstance(session_id, str) or not is_valid_new_session_id(session_id):
            raise invalid_session_id()
        metadata = body.get("metadata")
        metadata = {} if metadata is None else metadata
        if not isinstance(metadata, dict):
            raise bad_request(ErrorCode.INVALID_METADATA, "metadata must be a JSON object")
        # Before anything serializes it: orjson refuses deeper nesting than its limit (which would be
        # a 500), and the journal, dumps and export headers nest metadata a few levels deeper still.
        if not json_depth_within(metadata):
            raise bad_request(
                ErrorCode.INVALID_METADATA, f"metadata nests deeper than {MAX_JSON_DEPTH} levels"
            )
        if metadata and len(orjson.dumps(metadata)) > settings.max_metadata_bytes:
            raise bad_request(
                ErrorCode.INVALID_METADATA, f"metadata exceeds {settings.max_metadata_bytes} bytes"
            )
        if settings.rss_soft_limit_bytes and recent_rss_bytes() >= settings.rss_soft_limit_bytes:
            runtime.counters.sessions_refused_memory += 1
            raise unavailable(
                ErrorCode.MEMORY_PRESSURE,
                "this proxy is near its memory budget; start the session on another one",
                5,
            )
        runtime.storage.require_writable("the session was not created")
        refuse_over_capacity()
        key = new_session_key()
        session = Session(session_id, key_digest(key), metadata)
        runtime.store.add(session)
        try:
            await runtime.storage.commit(runtime.storage.created(session))
        except Failure:
            runtime.store.discard_new(session)  # nobody has its key: as if it never was
            raise
        runtime.counters.sessions_created += 1
        runtime.admission.enqueued += 1
        path = f"/v1/sessions/{session_id}"
        base = (settings.public_url or "").rstrip("/")
        return json_response(
            {
                "session_id": session_id,
                "session_key": key,
                "proxy_url": settings.public_url,
                "base_url": base + path,
                # The same session from its URL alone, any or no API key (absolute with public_url).
                "capability_url": base + capability_path(session_id, key),
            },
            201,
        )

    @router.get("/v1/sessions")
    async def list_sessions(request: Request, limit: int = 100) -> Response:
        require_admin(request)
        limit = max(1, min(limit, 10000))
        sessions = [s.summary() for _, s in zip(range(limit), runtime.store, strict=False)]
        return json_response({"total": len(runtime.store), "sessions": sessions})

    @router.get("/v1/sessions/{session_id}")
    async def get_session(session_id: str, request: Request, tokens: bool = False) -> Response:
        session = authorized_session(request, session_id)
        data = session.summary()
        if tokens:
            data["trajectory"] = session.trajectory()
        return json_response(data)

    @router.delete("/v1/sessions/{session_id}", status_code=204)
    async def delete_session(session_id: str, request: Request) -> Response:
        authorized_session(request, session_id)
        session = runtime.store.remove(session_id, "deleted by the client")
        runtime.in_flight.cancel(session, CancelCause.DELETED)
        runtime.counters.sessions_deleted += 1
        runtime.counters.sessions_evicted += 1
        try:
            await runtime.storage.commit(runtime.storage.ended(session, "deleted by the client"))
        except Failure as exc:
            raise DeletionNotDurable(session_id, exc) from None
        return Response(status_code=204)

    @router.post("/v1/sessions/{session_id}/reward")
    async def reward(session_id: str, request: Request) -> Response:
        authorized_session(request, session_id)  # 401/404 before the body is even read
        body = await read_json(request)
        session = authorized_session(request, session_id)
        if not isinstance(body, dict):
            raise not_a_json_object()
        value = body.get("reward")
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or abs(value) > MAX_REWARD
        ):
            raise bad_request(
                ErrorCode.INVALID_REWARD, f"reward must be a finite number within ±{MAX_REWARD:.6g}"
            )
        turn = body.get("turn")
        if turn is not None and (
            isinstance(turn, bool) or not isinstance(turn, int) or not 0 <= turn < session.num_turns
        ):
            raise bad_request(ErrorCode.INVALID_TURN, f"turn must be an integer in [0, {session.num_turns})")
        session.set_reward(float(value), turn)
        session.touch()
        await runtime.storage.commit(runtime.storage.rewarded(session, float(value), turn))
        return json_response(session.summary())

    @router.post("/v1/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request) -> Response:
        session = authorized_session(request, session_id)
        if session.busy:
            raise TurnInFlight(session_id)
        if runtime.store.mark_finished(session):
            session.touch()  # the trainer gets a whole stale timeout to export it
            runtime.counters.sessions_finished += 1
            await runtime.storage.commit(runtime.storage.finished(session))
        return json_response(session.summary())

    return router
