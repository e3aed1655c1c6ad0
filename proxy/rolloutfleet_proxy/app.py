"""The proxy's HTTP app (FastAPI): its routes, by area, built from the runtime, and its error replies."""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from rolloutfleet_wire.errors import ErrorCode
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from .errors import ProxyError, error_response, failure_handler
from .failures import Failure
from .middleware import BUDGET_RETRY_AFTER_S, BodyTooLarge, BudgetExhausted, RequestBudget, RequestMiddleware
from .operation_routes import operation_router
from .route_auth import RouteAuth
from .runtime import ProxyRuntime
from .session_routes import session_router
from .settings import ProxySettings
from .trainer_routes import trainer_router
from .turn_routes import turn_routes


def create_app(settings: ProxySettings, runtime: ProxyRuntime | None = None) -> FastAPI:
    runtime = runtime or ProxyRuntime(settings)
    auth = RouteAuth(runtime, settings.admin_key.get_secret_value())

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

    @app.exception_handler(ProxyError)
    async def _proxy_error(request: Request, exc: ProxyError) -> Response:
        return exc.to_response(request.url.path)

    app.add_exception_handler(Failure, failure_handler)

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(request: Request, exc: RequestValidationError) -> Response:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        return error_response(400, ErrorCode.INVALID_PARAMETER, problems, path=request.url.path)

    @app.exception_handler(BodyTooLarge)
    async def _too_large(request: Request, _exc: BodyTooLarge) -> Response:
        return error_response(
            413,
            ErrorCode.BODY_TOO_LARGE,
            f"request body exceeds {runtime.max_body_bytes} bytes",
            path=request.url.path,
        )

    @app.exception_handler(BudgetExhausted)
    async def _over_budget(request: Request, exc: BudgetExhausted) -> Response:
        return error_response(
            503,
            ErrorCode.REQUEST_BUDGET,
            str(exc),
            {"Retry-After": str(BUDGET_RETRY_AFTER_S)},
            request.url.path,
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = {404: ErrorCode.NOT_FOUND, 405: ErrorCode.METHOD_NOT_ALLOWED}.get(
            exc.status_code, ErrorCode.HTTP_ERROR
        )
        headers = getattr(exc, "headers", None)
        return error_response(exc.status_code, code, str(exc.detail), headers, request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        message = f"{type(exc).__name__}: {exc}"
        return error_response(500, ErrorCode.INTERNAL_ERROR, message, path=request.url.path)

    # The routers' routes join the app's own table, flat and in this order: FastAPI's include_router
    # would add a lazily resolved branch that every request (the chat turn too) walks through.
    app.router.routes.extend(session_router(runtime, settings, auth).routes)
    app.router.routes.extend(turn_routes(runtime, settings, auth))  # plain Starlette: the hot path
    app.router.routes.extend(trainer_router(runtime, auth.require_admin).routes)
    app.router.routes.extend(operation_router(runtime, settings, auth.require_admin).routes)

    app.add_middleware(
        RequestMiddleware,
        counters=runtime.counters,
        max_body_bytes=runtime.max_body_bytes,
        log_requests=settings.log_requests,
        budget=RequestBudget(settings.max_request_bytes_in_flight, runtime.gauges),
    )
    return app
