"""HTTP routes of the proxy (FastAPI)."""

from __future__ import annotations

import hmac
import math
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from rolloutfleet_wire.errors import ErrorCode
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response, StreamingResponse

from .admission import CONCURRENCY_RETRY_AFTER_S, STALENESS_RETRY_AFTER_S, limiting_bound
from .errors import (
    ProxyError,
    bad_request,
    draining,
    error_response,
    failure_handler,
    invalid_session_id,
    not_a_json_object,
    session_busy,
    too_many,
    unauthorized,
    unavailable,
)
from .failures import Failure
from .ids import (
    is_valid_new_session_id,
    is_valid_session_id,
    key_digest,
    key_matches,
    new_session_id,
    new_session_key,
)
from .middleware import BUDGET_RETRY_AFTER_S, BodyTooLarge, BudgetExhausted, RequestBudget, RequestMiddleware
from .openai_format import (
    Completion,
    completion_body,
    completion_sse,
    json_body,
    logprobs_content,
    parse_chat_request,
)
from .responses import json_response
from .runtime import ProxyRuntime
from .session import Session
from .settings import ProxySettings, effective_settings
from .stats import StatsCollector, recent_rss_bytes
from .trainer_routes import add_trainer_routes

# Exports hold rewards as float32: anything larger would become inf there.
MAX_REWARD = float(np.finfo(np.float32).max)


def bearer_key(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    if header[:7].lower() == "bearer " and header[7:].strip():
        return header[7:].strip()
    return None


def create_app(settings: ProxySettings, runtime: ProxyRuntime | None = None) -> FastAPI:
    runtime = runtime or ProxyRuntime(settings)
    admin_digest = key_digest(settings.admin_key.get_secret_value())
    registry = CollectorRegistry(auto_describe=True)
    registry.register(StatsCollector(runtime.stats))

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await runtime.start()
        try:
            yield
        finally:
            await runtime.stop()

    # No slash redirects: a 307 with an empty body is no answer for an API client; a JSON 404 is.
    app = FastAPI(
        title="RolloutFleet proxy", lifespan=lifespan, docs_url=None, redoc_url=None, redirect_slashes=False
    )
    app.state.runtime = runtime

    def is_admin(key: str) -> bool:
        return hmac.compare_digest(key_digest(key), admin_digest)

    def require_admin(request: Request) -> None:
        key = bearer_key(request)
        if key is None or not is_admin(key):
            raise unauthorized("this route needs the admin key")

    def authorized_session(request: Request, session_id: str) -> Session:
        key = bearer_key(request)
        if key is None:
            raise unauthorized()
        if not is_valid_session_id(session_id):
            raise invalid_session_id()
        if runtime.gauges.draining:  # before the lookup: drained sessions are no longer in the store
            raise draining("the proxy is shutting down; its sessions continue on its replacement")
        session = runtime.store.get(session_id)
        if not (key_matches(key, session.key_digest) or is_admin(key)):
            raise unauthorized("the key does not belong to this session")
        session.touch()
        return session

    async def read_json(request: Request) -> Any:
        return json_body(await request.body())

    @app.exception_handler(ProxyError)
    async def _proxy_error(_request: Request, exc: ProxyError) -> Response:
        return exc.to_response()

    app.add_exception_handler(Failure, failure_handler)

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(_request: Request, exc: RequestValidationError) -> Response:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        return error_response(400, ErrorCode.INVALID_PARAMETER, problems)

    @app.exception_handler(BodyTooLarge)
    async def _too_large(_request: Request, _exc: BodyTooLarge) -> Response:
        return error_response(
            413, ErrorCode.BODY_TOO_LARGE, f"request body exceeds {settings.max_body_bytes} bytes"
        )

    @app.exception_handler(BudgetExhausted)
    async def _over_budget(_request: Request, exc: BudgetExhausted) -> Response:
        return error_response(
            503, ErrorCode.REQUEST_BUDGET, str(exc), {"Retry-After": str(BUDGET_RETRY_AFTER_S)}
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> Response:
        code = {404: ErrorCode.NOT_FOUND, 405: ErrorCode.METHOD_NOT_ALLOWED}.get(
            exc.status_code, ErrorCode.HTTP_ERROR
        )
        return error_response(exc.status_code, code, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> Response:
        return error_response(500, ErrorCode.INTERNAL_ERROR, f"{type(exc).__name__}: {exc}")

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

    # --- sessions -------------------------------------------------------------------------------

    @app.post("/v1/sessions", status_code=201)
    async def create_session(request: Request) -> Response:
        require_admin(request)
        raw = await request.body()
        body = json_body(raw) if raw.strip() else {}
        if not isinstance(body, dict):
            raise not_a_json_object()
        if runtime.gauges.draining or not runtime.started:
            raise draining("this proxy is not taking new sessions; use another one")
        session_id = body.get("session_id")
        session_id = new_session_id() if session_id is None else session_id  # "", 0, false are errors
        if not isinstance(session_id, str) or not is_valid_new_session_id(session_id):
            raise invalid_session_id()
        metadata = body.get("metadata")
        metadata = {} if metadata is None else metadata
        if not isinstance(metadata, dict):
            raise bad_request(ErrorCode.INVALID_METADATA, "metadata must be a JSON object")
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
        runtime.log.require_writable("the session was not created")
        refuse_over_capacity()
        key = new_session_key()
        session = Session(session_id, key_digest(key), metadata)
        runtime.store.add(session)
        try:
            await runtime.log.commit(runtime.log.created(session))
        except ProxyError:
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
            },
            201,
        )

    @app.get("/v1/sessions")
    async def list_sessions(request: Request, limit: int = 100) -> Response:
        require_admin(request)
        limit = max(1, min(limit, 10000))
        sessions = [s.summary() for _, s in zip(range(limit), runtime.store, strict=False)]
        return json_response({"total": len(runtime.store), "sessions": sessions})

    @app.get("/v1/settings")
    async def running_settings(request: Request) -> Response:
        require_admin(request)
        return json_response(effective_settings(settings))

    @app.get("/v1/sessions/{session_id}")
    async def get_session(session_id: str, request: Request, tokens: bool = False) -> Response:
        session = authorized_session(request, session_id)
        data = session.summary()
        if tokens:
            data["trajectory"] = session.trajectory()
        return json_response(data)

    @app.delete("/v1/sessions/{session_id}", status_code=204)
    async def delete_session(session_id: str, request: Request) -> Response:
        authorized_session(request, session_id)
        session = runtime.store.remove(session_id, "deleted by the client")
        if session.in_flight is not None:
            session.in_flight.cancel()
        runtime.counters.sessions_deleted += 1
        runtime.counters.sessions_evicted += 1
        try:
            await runtime.log.commit(runtime.log.ended(session, "deleted by the client"))
        except ProxyError as exc:
            raise ProxyError(
                exc.status,
                exc.code,
                f"session {session_id} is deleted here, but the deletion could not be made durable: it may "
                f"come back after a restart of this proxy ({exc.message})",
                exc.headers,
            ) from None
        return Response(status_code=204)

    @app.post("/v1/sessions/{session_id}/reward")
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
        await runtime.log.commit(runtime.log.rewarded(session, float(value), turn))
        return json_response(session.summary())

    @app.post("/v1/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request) -> Response:
        session = authorized_session(request, session_id)
        if session.busy:
            raise session_busy(session_id, "has a turn in flight")
        if runtime.store.mark_finished(session):
            runtime.counters.sessions_finished += 1
            await runtime.log.commit(runtime.log.finished(session))
        return json_response(session.summary())

    # The hot path is a plain Starlette route: FastAPI's dependency solving costs every turn CPU.
    async def chat(request: Request) -> Response:
        session_id = request.path_params["session_id"]
        authorized_session(request, session_id)  # 401/404 before the body is even read
        body = await read_json(request)
        chat_request = parse_chat_request(
            body, settings.default_max_tokens, settings.chat_template_kwargs, settings.tool_call_parser
        )
        # Looked up again after the await: from here to taking the session lock nothing yields,
        # so cleanup cannot detach the session in between.
        session = authorized_session(request, session_id)
        assert runtime.turns is not None and runtime.tokenizer is not None
        timings = request.scope["state"].setdefault("timings", {})
        result = await runtime.turns.run_turn(session, chat_request, timings)
        gen = result.generation
        logprobs = None
        if chat_request.logprobs:
            logprobs = logprobs_content(
                runtime.tokenizer.token_strings(gen.output_ids), gen.logprobs.tolist()
            )
        completion = Completion(
            completion_id=f"chatcmpl-{session_id}-{result.turn_index}",
            model=settings.model_name,
            reply=result.reply,
            finish=gen.finish_reason,
            prompt_tokens=result.prompt_tokens,
            completion_tokens=len(gen.output_ids),
            logprobs=logprobs,
            extra={"session_id": session_id, "turn": result.turn_index},
        )
        if chat_request.stream:
            return StreamingResponse(
                completion_sse(completion, chat_request.include_usage),
                media_type="text/event-stream",
            )
        return Response(completion_body(completion), media_type="application/json")

    app.add_route("/v1/sessions/{session_id}/chat/completions", chat, methods=["POST"])

    add_trainer_routes(app, runtime, require_admin)

    # --- operations -----------------------------------------------------------------------------

    @app.get("/stats")
    async def stats() -> Response:
        return json_response(runtime.stats())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz")
    async def healthz() -> Response:
        return json_response({"status": "ok"})

    @app.get("/readyz")
    async def readyz() -> Response:
        if runtime.gauges.draining:
            return error_response(503, ErrorCode.DRAINING, "the proxy is draining for shutdown")
        if not runtime.started:
            return error_response(503, ErrorCode.STARTING, "the proxy is starting")
        if not runtime.storage.ok:
            return error_response(
                503,
                ErrorCode.STORAGE_UNAVAILABLE,
                f"the proxy cannot write to its dump volume: {runtime.storage.reason}",
            )
        return json_response({"status": "ready"})

    app.add_middleware(
        RequestMiddleware,
        counters=runtime.counters,
        max_body_bytes=settings.max_body_bytes,
        log_requests=settings.log_requests,
        budget=RequestBudget(settings.max_request_bytes_in_flight, runtime.gauges),
    )
    return app
