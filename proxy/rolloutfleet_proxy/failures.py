"""Why the store, the journal, the export buffer, the generation gate, the upstream and a turn refuse:
domain exceptions.

Each carries its ErrorCode and the facts, and knows no HTTP: `errors.http_error` is the one place
they become an answer (status, headers). Raising one never changes state.
"""

from __future__ import annotations

from typing import ClassVar

from rolloutfleet_wire.errors import ErrorCode


class Failure(Exception):
    code: ClassVar[ErrorCode]

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


def _some(ids: list[str], shown: int = 20) -> str:
    more = f" and {len(ids) - shown} more" if len(ids) > shown else ""
    return ", ".join(ids[:shown]) + more


# --- sessions (the store) -------------------------------------------------------------------------


class UnknownSession(Failure):
    code = ErrorCode.NOT_FOUND

    def __init__(self, session_id: str):
        super().__init__(f"unknown session {session_id}, or not one this key opens")
        self.session_id = session_id


class UnknownSessions(Failure):
    code = ErrorCode.NOT_FOUND

    def __init__(self, session_ids: list[str]):
        super().__init__(f"unknown session ids: {_some(session_ids)}")
        self.session_ids = session_ids


class SessionExists(Failure):
    code = ErrorCode.SESSION_EXISTS

    def __init__(self, session_id: str):
        super().__init__(f"session {session_id} already exists")
        self.session_id = session_id


class SessionBeingWritten(Failure):
    """Detached for a dump or an export: the next answer is 410, or 200 if the write failed."""

    code = ErrorCode.SESSION_BUSY

    def __init__(self, session_id: str):
        super().__init__(f"session {session_id} is being written to disk; retry")
        self.session_id = session_id


class SessionLostInRestart(Failure):
    code = ErrorCode.SESSION_LOST

    def __init__(self, session_id: str, why: str):
        super().__init__(f"session {session_id} was lost in a restart of this proxy: {why}")
        self.session_id, self.why = session_id, why


class SessionEnded(Failure):
    code = ErrorCode.SESSION_GONE

    def __init__(self, session_id: str, reason: str | None):
        super().__init__(f"session {session_id} has ended: {reason}")
        self.session_id, self.reason = session_id, reason


class SessionsNotFinished(Failure):
    code = ErrorCode.SESSION_NOT_FINISHED

    def __init__(self, session_ids: list[str]):
        super().__init__(f"sessions not finished (finish them first): {_some(session_ids)}")
        self.session_ids = session_ids


# --- storage (the journal and the dump volume) ----------------------------------------------------


class StorageUnavailable(Failure):
    """The proxy cannot write to its dump volume: nothing was recorded."""

    code = ErrorCode.STORAGE_UNAVAILABLE

    def __init__(self, what: str, reason: str):
        super().__init__(
            f"{what}: this proxy cannot write to its dump volume ({reason}); nothing was recorded"
        )
        self.what, self.reason = what, reason


class DeletionNotDurable(Failure):
    """A session was removed from memory, but its deletion could not be journaled (`cause`)."""

    def __init__(self, session_id: str, cause: Failure):
        super().__init__(
            f"session {session_id} is deleted here, but the deletion could not be made durable: it may "
            f"come back after a restart of this proxy ({cause.message})"
        )
        self.session_id, self.cause = session_id, cause
        self.code = cause.code  # type: ignore[misc]  # the cause's


# --- export batches -------------------------------------------------------------------------------


class UnknownBatch(Failure):
    code = ErrorCode.NOT_FOUND

    def __init__(self, batch_id: str):
        super().__init__(f"unknown export batch {batch_id}")
        self.batch_id = batch_id


class BatchEnded(Failure):
    """A batch no longer held: `code` says how it left (acknowledged, expired, drained)."""

    def __init__(self, batch_id: str, code: ErrorCode, message: str):
        super().__init__(message)
        self.batch_id = batch_id
        self.code = code  # type: ignore[misc]  # per batch, not per class


# --- generation and turns -------------------------------------------------------------------------


class ShuttingDown(Failure):
    """The proxy is draining: nothing was recorded; the work continues on its replacement."""

    code = ErrorCode.DRAINING


class PauseOutlasted(Failure):
    code = ErrorCode.GENERATION_PAUSED

    def __init__(self, max_wait_s: float):
        super().__init__(
            f"generation is paused (weights are being updated) and did not resume within "
            f"{max_wait_s:g}s; nothing was recorded, retry the turn"
        )
        self.max_wait_s = max_wait_s


class SessionFinished(Failure):
    code = ErrorCode.SESSION_FINISHED

    def __init__(self, session_id: str):
        super().__init__(f"session {session_id} is finished")
        self.session_id = session_id


class TurnInFlight(Failure):
    code = ErrorCode.SESSION_BUSY

    def __init__(self, session_id: str):
        super().__init__(f"session {session_id} already has a turn in flight")
        self.session_id = session_id


class SessionDeleted(Failure):
    code = ErrorCode.SESSION_DELETED

    def __init__(self, session_id: str):
        super().__init__(
            f"session {session_id} was deleted during this turn; the reply was discarded unrecorded"
        )
        self.session_id = session_id


class ClientGone(Failure):
    code = ErrorCode.CLIENT_CLOSED_REQUEST

    def __init__(self, session_id: str):
        super().__init__(
            f"the client of session {session_id} disconnected during this turn; its generation was "
            "cancelled and nothing was recorded"
        )
        self.session_id = session_id


class NoNewMessages(Failure):
    code = ErrorCode.NO_NEW_MESSAGES

    def __init__(self, recorded: int):
        super().__init__(f"the session has recorded {recorded} messages; send the full history plus new ones")
        self.recorded = recorded


class UnknownPreviousTurn(Failure):
    """A request continues a turn (Responses' previous_response_id) that is not a delivered one."""

    code = ErrorCode.PREVIOUS_RESPONSE_NOT_FOUND

    def __init__(self, session_id: str, turn: int):
        super().__init__(
            f"previous_response_id names turn {turn} of session {session_id}, which is no delivered turn of "
            "it (nothing was recorded)"
        )
        self.session_id, self.turn = session_id, turn


class ToolResultWithoutCall(Failure):
    """A tool result that opens a request continuing a turn answers no call of that turn's reply."""

    code = ErrorCode.UNKNOWN_TOOL_CALL_ID

    def __init__(self, call_id: str, made: list[str]):
        super().__init__(
            f"a tool result answers call {call_id!r}, which the previous response did not make (its calls: "
            f"{', '.join(made) or 'none'})"
        )
        self.call_id, self.made = call_id, made


class IdempotencyKeyReused(Failure):
    code = ErrorCode.IDEMPOTENCY_KEY_REUSED

    def __init__(self, session_id: str):
        super().__init__(
            f"this Idempotency-Key was used in session {session_id} for another request (other messages, "
            "tools or parameters); a key names one request: use a new key for a new request"
        )
        self.session_id = session_id


class TooManyBranches(Failure):
    code = ErrorCode.TOO_MANY_BRANCHES

    def __init__(self, session_id: str, limit: int):
        super().__init__(
            f"session {session_id} would have more than {limit} branches (max_branches_per_session); "
            "nothing was recorded: continue an existing branch, or start a new session"
        )
        self.session_id, self.limit = session_id, limit


class NewMessagesTooLarge(Failure):
    code = ErrorCode.NEW_MESSAGES_TOO_LARGE

    def __init__(self, size: int, limit: int):
        super().__init__(
            f"the new messages of this turn hold {size} bytes of text; the most is "
            f"{limit} (max_new_message_bytes)"
        )
        self.size, self.limit = size, limit


class TemplateFailed(Failure):
    code = ErrorCode.TEMPLATE_ERROR


class ImageNotTaken(Failure):
    """An image part the proxy refuses (broken, too large, a format or a medium it does not take):
    `code` says which. Nothing was recorded."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code  # type: ignore[misc]  # per refusal, not per class


class UpstreamAborted(Failure):
    code = ErrorCode.UPSTREAM_ABORTED

    def __init__(self, attempts: int, abort_message: str | None, waited_s: float):
        super().__init__(
            f"SGLang kept aborting this turn's generation for {waited_s:.0f}s ({attempts} attempts; last: "
            f"{abort_message}), longer than abort_ride_through_s; nothing was recorded, retry the turn"
        )
        self.attempts, self.abort_message, self.waited_s = attempts, abort_message, waited_s


# --- the upstream (SGLang) ------------------------------------------------------------------------


class UpstreamFailed(Failure):
    """SGLang failed, could not be reached or answered what is not an answer: nothing was recorded."""

    code = ErrorCode.UPSTREAM_ERROR


class UpstreamTimedOut(Failure):
    """SGLang did not answer within `upstream_timeout_s`: nothing was recorded."""

    code = ErrorCode.UPSTREAM_TIMEOUT


class UpstreamImageMismatch(Failure):
    """SGLang's expansion of the prompt's images disagrees with the model directory's processor, or
    with the counts recorded on earlier turns: nothing was recorded."""

    code = ErrorCode.UPSTREAM_IMAGE_MISMATCH


class UpstreamRoutingMissing(Failure):
    """Routing replay is on and SGLang's answer lacks the routing of some token, or it does not fit
    the model: nothing was recorded."""

    code = ErrorCode.UPSTREAM_ROUTING_MISSING


class UpstreamRefused(Failure):
    """SGLang refused the turn (400) as one it will not run: the client's problem, not a retry's."""

    explanation: ClassVar[str] = ""

    def __init__(self, refusal: str):
        super().__init__(f"SGLang refused the turn: {refusal}{self.explanation}")
        self.refusal = refusal


class ContextLengthExceeded(UpstreamRefused):
    code = ErrorCode.CONTEXT_LENGTH_EXCEEDED
    explanation = " (the conversation has reached the model's context length)"


class SamplingRefused(UpstreamRefused):
    code = ErrorCode.INVALID_SAMPLING_PARAMS
