"""Operations routes: liveness, readiness, stats, Prometheus metrics, the running settings (admin)."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from rolloutfleet_wire.errors import ErrorCode
from starlette.responses import Response

from .errors import error_response
from .responses import json_response
from .runtime import ProxyRuntime
from .settings import ProxySettings, effective_settings
from .stats import StatsCollector


def operation_router(
    runtime: ProxyRuntime, settings: ProxySettings, require_admin: Callable[[Request], None]
) -> APIRouter:
    router = APIRouter()
    registry = CollectorRegistry(auto_describe=True)
    registry.register(StatsCollector(runtime.stats))

    @router.get("/v1/settings")
    async def running_settings(request: Request) -> Response:
        require_admin(request)
        return json_response(effective_settings(settings))

    @router.get("/stats")
    async def stats() -> Response:
        return json_response(runtime.stats())

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @router.get("/healthz")
    async def healthz() -> Response:
        return json_response({"status": "ok"})

    @router.get("/readyz")
    async def readyz() -> Response:
        if runtime.lifecycle.draining:
            return error_response(503, ErrorCode.DRAINING, "the proxy is draining for shutdown")
        if not runtime.lifecycle.serving:
            return error_response(503, ErrorCode.STARTING, "the proxy is starting")
        health = runtime.storage.health
        if not health.ok:
            return error_response(
                503,
                ErrorCode.STORAGE_UNAVAILABLE,
                f"the proxy cannot write to its dump volume: {health.reason}",
            )
        return json_response({"status": "ready"})

    return router
