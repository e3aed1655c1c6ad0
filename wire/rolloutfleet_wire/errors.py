"""The error codes of the proxy's JSON error answers (`{"error": {"code", "message", "type"}}`).

The proxy raises them, the clients decide on them (retry, ride through a restart, give up), and
docs/proxy.md lists them; all three read this one vocabulary.
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    STORAGE_UNAVAILABLE = "storage_unavailable"  # 503: the proxy cannot persist; nothing was recorded
    SESSION_LOST = "session_lost"  # 410: journaled, but not recoverable after a restart
    REQUEST_BUDGET = "request_budget_exhausted"  # 503: too many request bytes in flight; retry after
