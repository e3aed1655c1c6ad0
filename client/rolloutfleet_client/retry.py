"""Which answers mean "the owner is restarting, wait" and which are fatal, and how long to wait.

Pure: functions of a status, an error code, an exception type and the time already spent; no I/O,
no clock, randomness passed in. `fleet_client` applies them. The rules:

Session calls (turns, reward, finish, get, delete; always sent to the session's owner):

=======================================================  ===========================================
answer                                                   verdict
=======================================================  ===========================================
connection refused, DNS failure, connect/pool timeout    WAIT (nothing was sent)
connection reset / closed before the answer              WAIT, and the request *may have been
                                                         handled* (see the turn rules below)
read or write timeout                                    FATAL (the proxy is alive but slower than
                                                         the client timeout: set it above the
                                                         proxy's ``upstream_timeout_s``)
503 ``draining``, ``generation_paused``, other 503       WAIT (nothing recorded; a drained session
                                                         continues on the replacement)
502 (``upstream_error``, or a balancer in front)         WAIT (nothing recorded)
404                                                      CHECK_READY: ask the owner's ``/readyz``;
                                                         not 200 -> WAIT (a replacement restoring),
                                                         200 -> the session is lost (a proxy
                                                         answers a key that does not open the
                                                         session, and a session lost in its
                                                         restart, alike: 404 ``not_found``)
410 (``session_gone``, ``session_deleted``)              FATAL: the session has ended
410 ``session_lost``                                     FATAL (``SessionLost``): journaled, but the
                                                         owner's restart could not rebuild it (older
                                                         proxies; newer ones tell the admin key only)
503 ``storage_unavailable``                              WAIT (the owner cannot persist right now;
                                                         nothing was recorded)
409, 400, 401, 413, 504, 500, anything else              FATAL, with the proxy's message
=======================================================  ===========================================

After an attempt that may have been handled (a reset after the request was written):

- a turn answered 409 ``session_busy`` is the earlier attempt still running: WAIT;
- a turn answered 400 ``no_new_messages`` was recorded by the earlier attempt, whose reply was lost
  and cannot be fetched again: TURN_RECORDED (fatal, with its own error);
- a DELETE answered 404 was done by the earlier attempt: OK.

Session creation (``POST /v1/sessions`` at an endpoint) is never tied to a proxy: 503 ``draining``
or ``memory_pressure``, 429 ``over_capacity``, other 502/503, and any connection failure mean
OTHER_PROXY (try the next endpoint; once every endpoint refused, wait, at least ``Retry-After``);
400, 401, 409 and 500 are FATAL.

Waits: exponential from ``initial_s`` (0.2 s) by ``factor`` (2), capped at ``cap_s`` (5 s), never
less than the proxy's ``Retry-After`` when one applies (also capped), with a little jitter, and
never past the call's total deadline (``restart_timeout_s`` from the first failure).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import httpx
from rolloutfleet_wire.errors import RETRY_LATER, ErrorCode


class Action(enum.Enum):
    OK = "ok"
    WAIT = "wait"  # the owner is restarting or briefly unavailable: wait, resend the same request
    CHECK_READY = "check_ready"  # 404: wait if the owner is not ready yet, else the session is lost
    OTHER_PROXY = "other_proxy"  # creation refused here: try another endpoint, then wait
    TURN_RECORDED = "turn_recorded"  # a retried turn was recorded by an attempt whose answer was lost
    FATAL = "fatal"


@dataclass(frozen=True)
class Verdict:
    action: Action
    reason: str
    maybe_handled: bool = False  # the request may have reached the proxy and been acted on


# --- transport errors ---------------------------------------------------------------------------

# Never sent: safe to resend anything.
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
# Sent (perhaps) but the connection broke before an answer: the proxy went away.
_BROKEN = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError, httpx.CloseError)


def not_sent(exc: BaseException) -> bool:
    """The request never reached the server (no connection, or none from the pool): resending it is
    safe whatever it does. A connect timeout is one: a replaced pod's old address answers nothing."""
    return isinstance(exc, _NOT_SENT)


def classify_exception(exc: BaseException, *, creating: bool = False) -> Verdict:
    """Verdict for a failed request (an httpx exception)."""
    name = type(exc).__name__
    if not_sent(exc):
        return Verdict(Action.OTHER_PROXY if creating else Action.WAIT, f"unreachable ({name})")
    if isinstance(exc, _BROKEN):
        action = Action.OTHER_PROXY if creating else Action.WAIT
        return Verdict(action, f"connection lost ({name})", maybe_handled=True)
    return Verdict(Action.FATAL, f"{name}: {exc}")


# --- answers ------------------------------------------------------------------------------------

TURN, READ, WRITE, DELETE = "turn", "read", "write", "delete"  # kinds of session calls


_KNOWN_CODES = frozenset(ErrorCode) - {ErrorCode.HTTP_ERROR}


def nothing_done(status: int, code: str) -> bool:
    """The proxy did nothing, and the same request can succeed later. A code the proxy sends decides
    (`RETRY_LATER`, always as 502/503: the 410 `draining` of an export batch dropped at shutdown is
    final). Without a code we know (a balancer's answer, or a newer proxy's code), a 502/503 does."""
    if status not in (502, 503):
        return False
    return code in RETRY_LATER or code not in _KNOWN_CODES


def trainer_should_retry(status: int, code: str, *, repeatable: bool) -> bool:
    """Whether the trainer's client resends a call answered `status`/`code`. A call that must not
    run twice (building an export batch) is resent only when the proxy itself said it did nothing:
    a balancer's 502 may follow a request the proxy handled."""
    return nothing_done(status, code) and (repeatable or code in RETRY_LATER)


def classify_session_answer(status: int, code: str, *, call: str, maybe_handled: bool = False) -> Verdict:
    """Verdict for an answer to a session call of kind `call` (TURN, READ, WRITE or DELETE).
    `maybe_handled`: an earlier attempt of this same call may have been acted on."""
    if 200 <= status < 300:
        return Verdict(Action.OK, "ok")
    if nothing_done(status, code):
        return Verdict(Action.WAIT, f"{status} {code}")
    if status == 404:
        if maybe_handled and call == DELETE:
            return Verdict(Action.OK, "deleted by an earlier attempt")
        return Verdict(Action.CHECK_READY, f"404 {code}")
    if maybe_handled and call == TURN:
        if status == 409 and code == ErrorCode.SESSION_BUSY:
            return Verdict(Action.WAIT, f"409 {code}: the earlier attempt is still running")
        if status == 400 and code == ErrorCode.NO_NEW_MESSAGES:
            return Verdict(Action.TURN_RECORDED, f"400 {code} after a lost answer")
    return Verdict(Action.FATAL, f"{status} {code}")


def classify_create_answer(status: int, code: str) -> Verdict:
    """Verdict for an answer to `POST /v1/sessions` at one endpoint."""
    if 200 <= status < 300:
        return Verdict(Action.OK, "ok")
    if status == 429 or nothing_done(status, code):  # 429: over_capacity
        return Verdict(Action.OTHER_PROXY, f"{status} {code}")
    return Verdict(Action.FATAL, f"{status} {code}")


def retry_after_s(value: str | None) -> float | None:
    """The Retry-After header in seconds (the proxy sends whole seconds; HTTP dates are ignored)."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if seconds >= 0 else None


# --- waiting ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with a cap, a floor from Retry-After and a total deadline."""

    initial_s: float = 0.2
    factor: float = 2.0
    cap_s: float = 5.0
    jitter: float = 0.1  # each delay is scaled by a factor drawn from [1 - jitter, 1 + jitter]

    def __post_init__(self) -> None:
        if self.initial_s <= 0 or self.factor < 1 or self.cap_s < self.initial_s or not 0 <= self.jitter < 1:
            raise ValueError(f"invalid backoff {self}")

    def delay(self, attempt: int, retry_after: float | None = None, rand: float = 0.5) -> float:
        """Delay before retry number `attempt` (0 for the first retry). `rand` in [0, 1) picks
        the jitter (0.5: none)."""
        base = min(self.cap_s, self.initial_s * self.factor ** min(attempt, 64))
        if retry_after is not None:
            base = max(base, min(retry_after, self.cap_s))
        return base * (1 + self.jitter * (2 * rand - 1))

    def next_wait(
        self,
        attempt: int,
        elapsed_s: float,
        total_s: float,
        retry_after: float | None = None,
        rand: float = 0.5,
    ) -> float | None:
        """How long to wait before the next attempt, or None when `total_s` is used up (`elapsed_s`
        counts from the first failure). The last wait is shortened to end at the deadline."""
        remaining = total_s - elapsed_s
        if remaining <= 0:
            return None
        return min(self.delay(attempt, retry_after, rand), remaining)
