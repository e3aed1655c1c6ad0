"""Pure ASGI middleware: body size limit and one structured log line per request."""

from __future__ import annotations

import logging
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import error_body
from .stats import Counters

access_log = logging.getLogger("rolloutfleet.proxy.access")


class BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    """413 for bodies over the limit: declared (Content-Length) or streamed (counted as read)."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length" and (not value.isdigit() or int(value) > self.max_bytes):
                await self._reject(send)
                return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge()
            return message

        await self.app(scope, limited_receive, send)

    async def _reject(self, send: Send) -> None:
        body = error_body(413, "body_too_large", f"request body exceeds {self.max_bytes} bytes")
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


class RequestLogMiddleware:
    """Counts requests and logs method, path, status and the handler's timing buckets."""

    def __init__(self, app: ASGIApp, counters: Counters, enabled: bool):
        self.app = app
        self.counters = counters
        self.enabled = enabled

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.counters.requests += 1
        start = time.perf_counter()
        timings: dict[str, Any] = {}
        scope.setdefault("state", {})["timings"] = timings
        status = 500

        async def send_with_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            if self.enabled and access_log.isEnabledFor(logging.INFO):
                fields = {
                    "method": scope["method"],
                    "path": scope["path"],
                    "status": status,
                    "total_ms": round((time.perf_counter() - start) * 1000, 3),
                    **timings,
                }
                access_log.info("request", extra={"fields": fields})
