"""Session ids and keys: what a valid id is, how keys are made and checked."""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets

# A fixed, path-safe alphabet: no dots or slashes, so no id can name a path outside the dump directory.
SESSION_ID_RE = re.compile(r"[A-Za-z0-9_-]{8,64}")
# New ids also do not start with '-': an id is a file name and a command-line argument in operators'
# hands. Ids made before this rule (1 in 64 generated ids began with '-') stay valid everywhere else,
# so their sessions are restored and reachable after an upgrade.
NEW_SESSION_ID_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{7,63}")
SESSION_ID_RULE = "8 to 64 characters from A-Z, a-z, 0-9, '_' and '-', not starting with '-'"


def is_valid_session_id(session_id: str) -> bool:
    """An id the proxy may hold (lookups, dump files, restores)."""
    return SESSION_ID_RE.fullmatch(session_id) is not None


def is_valid_new_session_id(session_id: str) -> bool:
    """An id a new session may be given."""
    return NEW_SESSION_ID_RE.fullmatch(session_id) is not None


def new_session_id() -> str:
    """22 characters of the allowed alphabet (a leading '-' becomes '_')."""
    session_id = secrets.token_urlsafe(16)
    return "_" + session_id[1:] if session_id.startswith("-") else session_id


def new_session_key() -> str:
    return "rfs-" + secrets.token_urlsafe(32)


# A capability URL: the session's base URL with its key in the path, so the URL alone opens it.
CAPABILITY_SEGMENT = "cap"
_CAPABILITY_IN_PATH = re.compile(rf"(/{CAPABILITY_SEGMENT}/)[^/]+")


def capability_path(session_id: str, session_key: str) -> str:
    return f"/v1/sessions/{session_id}/{CAPABILITY_SEGMENT}/{session_key}"


def redact_capability(path: str) -> str:
    """A request path as it may be logged: a capability's secret replaced."""
    return _CAPABILITY_IN_PATH.sub(r"\1<redacted>", path)


def key_digest(key: str) -> bytes:
    """Only digests of session keys are kept (in memory and in dumps)."""
    return hashlib.sha256(key.encode()).digest()


def key_matches(key: str, digest: bytes) -> bool:
    return hmac.compare_digest(key_digest(key), digest)


def new_batch_id() -> str:
    """Export batch ids follow the session id rule (they name dump files too)."""
    return "batch-" + secrets.token_urlsafe(12)
