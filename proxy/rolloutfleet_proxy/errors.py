"""Errors a client sees: an HTTP status, a stable code (`ErrorCode`) and a message, as OpenAI-style JSON
(or in Anthropic's shape on the Messages routes, with the same code inside).

Routes and request parsers raise `ProxyError`s, built by the functions below (one per shape of
answer, so a repeated error is built one way everywhere). The domain failures of `failures.py`
become answers in `http_error`, the one mapping from failure to status, code and headers.
"""

from __future__ import annotations

import orjson
from rolloutfleet_wire.errors import ErrorCode
from starlette.requests import Request
from starlette.responses import Response

from . import failures as f
from .ids import SESSION_ID_RULE

DRAINING_RETRY_AFTER_S = 2  # a replacement takes over within seconds
STORAGE_RETRY_AFTER_S = 5
CLIENT_CLOSED_REQUEST_STATUS = 499  # nginx's code for a client that left before its answer


class ProxyError(Exception):
    """An error that maps to one HTTP response; raising it never changes session state."""

    def __init__(self, status: int, code: ErrorCode, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers or {}

    def to_response(self, path: str = "") -> Response:
        return error_response(self.status, self.code, self.message, self.headers, path)


# Anthropic's error types by status (its API reference, "Errors"); other statuses by class.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
# The Messages dialect's route ends so (`<session>/v1/messages`, where Anthropic's SDK posts).
ANTHROPIC_PATH_SUFFIX = "/v1/messages"


def error_body(status: int, code: ErrorCode, message: str, path: str = "") -> bytes:
    """The error as the dialect of the request's `path` shapes it: Anthropic's
    `{"type": "error", "error": {"type", "message"}}` under a Messages route, else OpenAI's; both carry
    the proxy's `code` inside `error`, where the rollout client reads it."""
    if path.endswith(ANTHROPIC_PATH_SUFFIX):
        kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
        return orjson.dumps({"type": "error", "error": {"type": kind, "message": message, "code": code}})
    kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
    return orjson.dumps({"error": {"code": code, "message": message, "type": kind}})


def error_response(
    status: int, code: ErrorCode, message: str, headers: dict[str, str] | None = None, path: str = ""
) -> Response:
    return Response(
        error_body(status, code, message, path),
        status_code=status,
        headers=headers,
        media_type="application/json",
    )


# --- the shapes of answer -------------------------------------------------------------------------


def _retry_after(seconds: int | None) -> dict[str, str] | None:
    return None if seconds is None else {"Retry-After": str(seconds)}


def bad_request(code: ErrorCode, message: str) -> ProxyError:
    return ProxyError(400, code, message)


def unauthorized(message: str = "missing or invalid bearer key") -> ProxyError:
    return ProxyError(401, ErrorCode.UNAUTHORIZED, message, {"WWW-Authenticate": "Bearer"})


def not_found(message: str) -> ProxyError:
    return ProxyError(404, ErrorCode.NOT_FOUND, message)


def conflict(code: ErrorCode, message: str, retry_after_s: int | None = None) -> ProxyError:
    return ProxyError(409, code, message, _retry_after(retry_after_s))


def gone(code: ErrorCode, message: str) -> ProxyError:
    return ProxyError(410, code, message)


def too_many(code: ErrorCode, message: str, retry_after_s: int) -> ProxyError:
    return ProxyError(429, code, message, _retry_after(retry_after_s))


def unavailable(code: ErrorCode, message: str, retry_after_s: int = 1) -> ProxyError:
    return ProxyError(503, code, message, _retry_after(retry_after_s))


# --- errors raised in more than one place ---------------------------------------------------------


def not_a_json_object() -> ProxyError:
    return bad_request(ErrorCode.INVALID_BODY, "the request body must be a JSON object")


def invalid_session_id() -> ProxyError:
    return bad_request(ErrorCode.INVALID_SESSION_ID, f"session ids are {SESSION_ID_RULE}")


def draining(message: str) -> ProxyError:
    """503 `draining`: shutting down; `message` says what becomes of the request's work."""
    return unavailable(ErrorCode.DRAINING, message, DRAINING_RETRY_AFTER_S)


# --- domain failures as answers -------------------------------------------------------------------


def http_error(failure: f.Failure) -> ProxyError:
    """The one mapping from a domain failure to its answer."""
    match failure:
        case f.UnknownSession() | f.UnknownSessions() | f.UnknownBatch():
            return not_found(failure.message)
        case f.SessionBeingWritten():
            return conflict(failure.code, failure.message, retry_after_s=1)
        case (
            f.SessionExists()
            | f.SessionsNotFinished()
            | f.SessionFinished()
            | f.TurnInFlight()
            | f.TooManyBranches()
        ):
            return conflict(failure.code, failure.message)
        case f.SessionLostInRestart() | f.SessionEnded() | f.SessionDeleted() | f.BatchEnded():
            return gone(failure.code, failure.message)
        case f.ShuttingDown():
            return draining(failure.message)
        case f.StorageUnavailable():
            return unavailable(failure.code, failure.message, STORAGE_RETRY_AFTER_S)
        case f.DeletionNotDurable():
            cause = http_error(failure.cause)
            return ProxyError(cause.status, cause.code, failure.message, cause.headers)
        case f.PauseOutlasted() | f.UpstreamAborted():
            return unavailable(failure.code, failure.message, 1)
        case (
            f.NoNewMessages()
            | f.NewMessagesTooLarge()
            | f.TemplateFailed()
            | f.UpstreamRefused()
            | f.ImageNotTaken()
            | f.UnknownPreviousTurn()
            | f.ToolResultWithoutCall()
        ):
            return bad_request(failure.code, failure.message)
        case f.UpstreamFailed() | f.UpstreamImageMismatch() | f.UpstreamRoutingMissing():
            return ProxyError(502, failure.code, failure.message)
        case f.UpstreamTimedOut():
            return ProxyError(504, failure.code, failure.message)
        case f.IdempotencyKeyReused():
            return ProxyError(422, failure.code, failure.message)
        case f.ClientGone():
            return ProxyError(CLIENT_CLOSED_REQUEST_STATUS, failure.code, failure.message)
    return ProxyError(
        500, ErrorCode.INTERNAL_ERROR, f"{type(failure).__name__}: {failure}"
    )  # unmapped: a bug


async def failure_handler(request: Request, exc: Exception) -> Response:
    """The Starlette exception handler for every domain failure (registered in `create_app`)."""
    assert isinstance(exc, f.Failure)
    return http_error(exc).to_response(request.url.path)
