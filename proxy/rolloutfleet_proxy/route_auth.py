"""Who may call a route: the admin key, or a session's own key (which also finds the session)."""

from __future__ import annotations

import hmac

from fastapi import Request

from .errors import draining, invalid_session_id, unauthorized
from .ids import is_valid_session_id, key_digest
from .runtime import ProxyRuntime
from .session import Session


def bearer_key(request: Request) -> str | None:
    """The key of `Authorization: Bearer`, or of `x-api-key` (how Anthropic's SDK sends its key)."""
    header = request.headers.get("authorization", "")
    if header[:7].lower() == "bearer " and header[7:].strip():
        return header[7:].strip()
    return request.headers.get("x-api-key", "").strip() or None


class RouteAuth:
    def __init__(self, runtime: ProxyRuntime, admin_key: str):
        self._runtime = runtime
        self._admin_digest = key_digest(admin_key)

    def is_admin(self, key: str) -> bool:
        return hmac.compare_digest(key_digest(key), self._admin_digest)

    def require_admin(self, request: Request) -> None:
        key = bearer_key(request)
        if key is None or not self.is_admin(key):
            raise unauthorized("this route needs the admin key")

    def authorized_session(self, request: Request, session_id: str) -> Session:
        """The session, if the request's key may use it: the admin key any, a session key its own. Any
        other key gets what an unknown id gets (404, the same body), so no key learns which ids exist.
        Not activity for the stale timeout: only the routes that change a session mark it active (a
        dashboard polling it must not keep it)."""
        runtime = self._runtime
        key = bearer_key(request)
        if key is None:
            raise unauthorized()
        if not is_valid_session_id(session_id):
            raise invalid_session_id()
        if runtime.lifecycle.draining:  # before the lookup: drained sessions are no longer in the store
            raise draining("the proxy is shutting down; its sessions continue on its replacement")
        digest = key_digest(key)
        if hmac.compare_digest(digest, self._admin_digest):
            return runtime.store.get(session_id)
        return runtime.store.get_with_key(session_id, digest)

    def capability_session(self, session_id: str, capability: str) -> Session:
        """The session a capability URL names: its secret is the session's key, so the URL alone
        opens it, whatever Authorization header comes with it (frameworks hand agents a bare base URL
        and `api_key="EMPTY"`). A wrong secret gets what an unknown id gets."""
        if not is_valid_session_id(session_id):
            raise invalid_session_id()
        if self._runtime.lifecycle.draining:
            raise draining("the proxy is shutting down; its sessions continue on its replacement")
        return self._runtime.store.get_with_key(session_id, key_digest(capability))
