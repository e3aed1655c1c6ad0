"""The error codes of the proxy's JSON error answers (`{"error": {"code", "message", "type"}}`).

The proxy answers only with these codes, the clients decide on them (retry, ride through a restart,
give up), and docs/proxy.md lists them; all three read this one vocabulary. The values are the wire
format: clients in the wild compare against them, so a value never changes.
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    # --- any route ---
    UNAUTHORIZED = "unauthorized"  # 401: no bearer key, or not the admin key on an admin route
    NOT_FOUND = "not_found"  # 404: no such route, session (or none the key opens) or export batch
    METHOD_NOT_ALLOWED = "method_not_allowed"  # 405
    HTTP_ERROR = "http_error"  # any other HTTP-level refusal (and what clients call an answer without a code)
    BODY_TOO_LARGE = "body_too_large"  # 413: the body exceeds max_body_bytes
    REQUEST_BUDGET = "request_budget_exhausted"  # 503: too many request bytes in flight; retry after
    INTERNAL_ERROR = "internal_error"  # 500: a bug
    INVALID_JSON = "invalid_json"  # 400: the body is not JSON
    INVALID_BODY = "invalid_body"  # 400: the body is JSON, but not the object the route takes
    INVALID_PARAMETER = "invalid_parameter"  # 400: a field or query parameter has a wrong value
    DRAINING = "draining"  # 503: shutting down; nothing recorded (410 for a batch dropped at shutdown)
    STARTING = "starting"  # 503 on /readyz: still restoring
    STORAGE_UNAVAILABLE = "storage_unavailable"  # 503: the proxy cannot persist; nothing was recorded
    # --- sessions ---
    INVALID_SESSION_ID = "invalid_session_id"  # 400
    INVALID_METADATA = "invalid_metadata"  # 400
    OVER_CAPACITY = "over_capacity"  # 429: admission has no room for another session; Retry-After
    MEMORY_PRESSURE = "memory_pressure"  # 503: near the memory budget; start the session elsewhere
    SESSION_EXISTS = "session_exists"  # 409
    SESSION_BUSY = "session_busy"  # 409: a turn is in flight, or the session is being written to disk
    SESSION_FINISHED = "session_finished"  # 409: no more turns after finish
    SESSION_NOT_FINISHED = "session_not_finished"  # 409: an export named a session still running
    SESSION_GONE = "session_gone"  # 410: ended (dumped after idling, exported, dropped)
    SESSION_DELETED = "session_deleted"  # 410: deleted during this turn
    SESSION_LOST = "session_lost"  # 410: journaled, but not recoverable after a restart
    INVALID_REWARD = "invalid_reward"  # 400
    INVALID_TURN = "invalid_turn"  # 400
    # --- turns ---
    INVALID_MESSAGES = "invalid_messages"  # 400
    UNSUPPORTED_PARAMETER = "unsupported_parameter"  # 400
    INVALID_TOOLS = "invalid_tools"  # 400
    INVALID_TOOL_CHOICE = "invalid_tool_choice"  # 400
    UNKNOWN_TOOL_CALL_ID = "unknown_tool_call_id"  # 400
    NO_NEW_MESSAGES = "no_new_messages"  # 400: nothing after the recorded history
    # 400: a Responses request's previous_response_id names no delivered turn of its session
    PREVIOUS_RESPONSE_NOT_FOUND = "previous_response_not_found"
    NEW_MESSAGES_TOO_LARGE = "new_messages_too_large"  # 400
    # Images (vision-language models): a broken or unreadable image, or a format not allowed; one over
    # max_image_bytes or a request's images over max_request_image_bytes; video, audio or file parts,
    # http(s) URLs when fetching is off, or images sent to a model directory without images.
    INVALID_IMAGE = "invalid_image"  # 400
    IMAGE_TOO_LARGE = "image_too_large"  # 400
    UNSUPPORTED_CONTENT = "unsupported_content"  # 400
    # No longer sent: a history that differs from the recorded one starts a branch (kept because codes
    # are never reused).
    HISTORY_MISMATCH = "history_mismatch"
    TOO_MANY_BRANCHES = "too_many_branches"  # 409: the session is at max_branches_per_session
    IDEMPOTENCY_KEY_REUSED = "idempotency_key_reused"  # 422: the key named another request
    TEMPLATE_ERROR = "template_error"  # 400: the chat template refused these messages
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # 400 (SGLang's refusal)
    INVALID_SAMPLING_PARAMS = "invalid_sampling_params"  # 400 (SGLang's refusal)
    GENERATION_PAUSED = "generation_paused"  # 503: the pause outlasted the wait; nothing was recorded
    UPSTREAM_ABORTED = "upstream_aborted"  # 503: SGLang aborted the turn too often; nothing was recorded
    UPSTREAM_ERROR = "upstream_error"  # 502: SGLang failed or answered nonsense; nothing was recorded
    UPSTREAM_TIMEOUT = "upstream_timeout"  # 504: SGLang did not answer within upstream_timeout_s
    # 502: SGLang expanded an image to another token count than the model directory's image processor
    # gives (the engine runs with another processor configuration), or changed an earlier image's
    # count: the trajectory could not be trained on; nothing was recorded. Not retryable.
    UPSTREAM_IMAGE_MISMATCH = "upstream_image_mismatch"
    # 502: routing replay is on, and SGLang answered without the routing of every token (an engine not
    # run with --enable-return-routed-experts, a gateway that drops return_routed_experts), or with
    # routing that does not fit the model: a trajectory without it could not be replayed; nothing was
    # recorded. Not retryable.
    UPSTREAM_ROUTING_MISSING = "upstream_routing_missing"
    # 499 (nginx's "client closed request"): the client went away during its turn, which was cancelled
    # unrecorded; nobody reads this answer, the access log and the counters do.
    CLIENT_CLOSED_REQUEST = "client_closed_request"
    # --- the trainer's routes ---
    INVALID_SESSION_IDS = "invalid_session_ids"  # 400
    INVALID_MAX_TRAJECTORIES = "invalid_max_trajectories"  # 400
    INVALID_BATCH_ID = "invalid_batch_id"  # 400
    INVALID_MODEL_VERSION = "invalid_model_version"  # 400
    BATCH_ALREADY_ACKNOWLEDGED = "batch_already_acknowledged"  # 410
    BATCH_EXPIRED = "batch_expired"  # 410: not acknowledged within the export TTL


# Answers meaning "nothing was done; the same request can succeed later" (the proxy sends them as
# 502/503, with Retry-After): a client waits and resends, to the same proxy for a session's calls.
RETRY_LATER: frozenset[ErrorCode] = frozenset(
    {
        ErrorCode.DRAINING,
        ErrorCode.STARTING,
        ErrorCode.STORAGE_UNAVAILABLE,
        ErrorCode.REQUEST_BUDGET,
        ErrorCode.MEMORY_PRESSURE,
        ErrorCode.GENERATION_PAUSED,
        ErrorCode.UPSTREAM_ABORTED,
        ErrorCode.UPSTREAM_ERROR,
    }
)
