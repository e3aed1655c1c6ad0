"""The errors `FleetClient` and the trainer client raise. Every error about a session names it and
its owner."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from rolloutfleet_wire.errors import ErrorCode


class NoAnswerCode(StrEnum):
    """The code of a `ProxyRequestError` without an answer (status None): made here, not by a proxy."""

    TRANSPORT_ERROR = "transport_error"  # FleetClient: a transport failure not worth retrying
    UNREACHABLE = "unreachable"  # TrainerClient: no answer, and no retries left


def proxy_error(response: Any) -> tuple[str, str]:
    """(code, message) of a proxy's error answer (`{"error": {"code", "message"}}`, an httpx
    response); `http_error` and something readable for anything else. The code is a plain string:
    compare it with `ErrorCode` members (a newer proxy may send one this client does not know)."""
    try:
        error = response.json()["error"]
        return str(error.get("code") or ErrorCode.HTTP_ERROR), str(error.get("message") or "")
    except Exception:
        return ErrorCode.HTTP_ERROR.value, response.text[:300]


class FleetClientError(RuntimeError):
    """Base class of the client's errors."""


class ProxyRequestError(FleetClientError):
    """A proxy refused a request with an answer that retrying will not fix (409 `history_mismatch`,
    400 `invalid_parameter`, 401, ...), or retries ran out. `message` is the proxy's own; `status`
    is None when no answer came (`code` is then a `NoAnswerCode`). Both clients raise it."""

    def __init__(
        self, url: str, status: int | None, code: str, message: str, session_id: str | None = None
    ) -> None:
        where = f"session {session_id} at {url}" if session_id else url
        super().__init__(f"{where}: {status} {code}: {message}")
        self.url, self.status, self.code, self.message = url, status, code, message
        self.session_id = session_id


class SessionError(FleetClientError):
    """Something happened to one session; `session_id` and `owner` say which and where."""

    def __init__(self, session_id: str, owner: str, message: str) -> None:
        super().__init__(f"session {session_id} (owner {owner}): {message}")
        self.session_id, self.owner = session_id, owner


class SessionLost(SessionError):
    """The owner (or its replacement under the same URL) is ready but does not know the session:
    it was not restored. The client never starts a new session in its place. (A proxy answers a key
    that does not open the session alike, so a session given a wrong key ends here too.)"""

    def __init__(self, session_id: str, owner: str, detail: str = "") -> None:
        message = "the owner is ready but answers 404 for this session: it is lost"
        super().__init__(session_id, owner, f"{message} ({detail})" if detail else message)


class SessionEnded(SessionError):
    """410: the session has ended (deleted during a turn, dumped after idling, exported)."""

    def __init__(self, session_id: str, owner: str, code: str, detail: str) -> None:
        super().__init__(session_id, owner, f"410 {code}: {detail}")
        self.code, self.detail = code, detail


class OwnerUnavailable(SessionError):
    """The owner did not come back within `restart_timeout_s`."""


class TurnOutcomeUnknown(SessionError):
    """A turn's connection broke after the request was sent, and the retry found the turn recorded:
    the reply text is lost (the proxy keeps only token ids). Read the session, or end it."""


class NoProxyAvailable(FleetClientError):
    """No endpoint accepted a new session within the creation deadline. `refusals` maps each
    endpoint to its last answer."""

    def __init__(self, refusals: dict[str, str], waited_s: float) -> None:
        detail = "; ".join(f"{url}: {reason}" for url, reason in refusals.items())
        super().__init__(f"no proxy accepted a new session within {waited_s:.1f}s ({detail})")
        self.refusals = refusals
