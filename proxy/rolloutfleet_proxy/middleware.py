"""One pure ASGI middleware for every request: count it, cap its body, bound the body bytes held by
all requests at once, log it with its timings.

One layer rather than two: every ASGI layer costs each request a few microseconds of CPU.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from rolloutfleet_wire.errors import ErrorCode
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import error_body
from .ids import redact_capability
from .stats import Counters, Gauges

BUDGET_RETRY_AFTER_S = 1

access_log = logging.getLogger("rolloutfleet.proxy.access")


class BodyTooLarge(Exception):
    pass


class BudgetExhausted(Exception):
    """The request bytes in flight would exceed the proxy's budget (a body sent without a length)."""


class RequestBudget:
    """Request body bytes held by requests being handled, against a budget: what bounds the memory
    that many large bodies at once can cost (each body costs a few times its size while parsed)."""

    def __init__(self, limit: int, gauges: Gauges):
        self.limit = limit
        self._gauges = gauges

    def take(self, size: int) -> bool:
        if size and self._gauges.request_bytes_in_flight + size > self.limit:
            return False
        self._gauges.request_bytes_in_flight += size
        return True

    def give_back(self, size: int) -> None:
        self._gauges.request_bytes_in_flight -= size


class RequestMiddleware:
    """413 for bodies over the limit, declared (Content-Length) or streamed (counted as read);
    one log line per request with method, path, status and the handler's timing buckets."""

    def __init__(
        self,
        app: ASGIApp,
        counters: Counters,
        max_body_bytes: int,
        log_requests: bool,
        budget: RequestBudget | None = None,
    ):
        self.app = app
        self.counters = counters
        self.max_bytes = max_body_bytes
        self.log_requests = log_requests
        self.budget = budget

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

        held = [0]  # body bytes this request holds against the budget
        try:
            declared = self._declared_length(scope)
            if declared is not None and (declared < 0 or declared > self.max_bytes):
                await self._reject(
                    scope["path"],
                    send_with_status,
                    413,
                    ErrorCode.BODY_TOO_LARGE,
                    f"request body exceeds {self.max_bytes} bytes",
                )
                return
            if declared and self.budget is not None:
                if not self.budget.take(declared):
                    self.counters.requests_over_budget += 1
                    await self._reject(
                        scope["path"], send_with_status, 503, ErrorCode.REQUEST_BUDGET, self._budget_message()
                    )
                    return
                held[0] = declared
            await self.app(scope, self._limited(receive, held), send_with_status)
        finally:
            if held[0] and self.budget is not None:
                self.budget.give_back(held[0])
            if self.log_requests and access_log.isEnabledFor(logging.INFO):
                fields = {
                    "method": scope["method"],
                    "path": redact_capability(scope["path"]),  # a capability URL is a secret
                    "status": status,
                    "total_ms": round((time.perf_counter() - start) * 1000, 3),
                    **timings,
                }
                access_log.info("request", extra={"fields": fields})

    def _budget_message(self) -> str:
        assert self.budget is not None
        return (
            f"this proxy holds the most request bytes it allows at once ({self.budget.limit}); "
            "retry shortly, or on another proxy"
        )

    @staticmethod
    def _declared_length(scope: Scope) -> int | None:
        for name, value in scope["headers"]:
            if name == b"content-length":
                return int(value) if value.isdigit() else -1
        return None

    def _limited(self, receive: Receive, held: list[int]) -> Receive:
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                size = len(message.get("body", b""))
                seen += size
                if seen > self.max_bytes:
                    raise BodyTooLarge()
                if seen > held[0] and self.budget is not None:  # sent without a length: taken as read
                    if not self.budget.take(seen - held[0]):
                        self.counters.requests_over_budget += 1
                        raise BudgetExhausted(self._budget_message())
                    held[0] = seen
            return message

        return limited_receive

    async def _reject(self, path: str, send: Send, status: int, code: ErrorCode, message: str) -> None:
        body = error_body(status, code, message, path)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if status == 503:
            headers.append((b"retry-after", str(BUDGET_RETRY_AFTER_S).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
