"""Errors a client sees: an HTTP status, a stable code and a message, as OpenAI-style JSON."""

from __future__ import annotations

import orjson
from rolloutfleet_wire.errors import ErrorCode
from starlette.responses import Response

# Codes clients act on (shared with them through rolloutfleet_wire.errors).
STORAGE_UNAVAILABLE = ErrorCode.STORAGE_UNAVAILABLE
SESSION_LOST = ErrorCode.SESSION_LOST
REQUEST_BUDGET = ErrorCode.REQUEST_BUDGET


class ProxyError(Exception):
    """An error that maps to one HTTP response; raising it never changes session state."""

    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers or {}

    def to_response(self) -> Response:
        return error_response(self.status, self.code, self.message, self.headers)


def error_body(status: int, code: str, message: str) -> bytes:
    kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
    return orjson.dumps({"error": {"code": code, "message": message, "type": kind}})


def error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(
        error_body(status, code, message), status_code=status, headers=headers, media_type="application/json"
    )


def bad_request(code: str, message: str) -> ProxyError:
    return ProxyError(400, code, message)


def unauthorized(message: str = "missing or invalid bearer key") -> ProxyError:
    return ProxyError(401, "unauthorized", message, {"WWW-Authenticate": "Bearer"})


def forbidden(message: str) -> ProxyError:
    return ProxyError(403, "forbidden", message)


def not_found(message: str) -> ProxyError:
    return ProxyError(404, "not_found", message)


def conflict(code: str, message: str) -> ProxyError:
    return ProxyError(409, code, message)


def gone(code: str, message: str) -> ProxyError:
    return ProxyError(410, code, message)


def unavailable(code: str, message: str, retry_after_s: int = 1) -> ProxyError:
    return ProxyError(503, code, message, {"Retry-After": str(retry_after_s)})
