"""Reads from the API on behalf of one pod: ConfigMaps, Secrets and its service-account tokens."""

from __future__ import annotations

import base64
import threading

from .credentials import TOKEN_SECONDS, Token, request_token
from .kube import Kube


class PodLookups:
    """Implements env.Lookups and volumes.VolumeLookups against the API."""

    def __init__(self, kube: Kube, pod: dict):
        self._kube = kube
        self._pod = pod
        self._tokens: dict[tuple[tuple[str, ...], int], Token] = {}
        self._lock = threading.Lock()

    def _get(self, kind: str, namespace: str, name: str) -> dict | None:
        return self._kube.get(f"/api/v1/namespaces/{namespace}/{kind}/{name}")

    def config_map_files(self, namespace: str, name: str) -> dict[str, bytes] | None:
        obj = self._get("configmaps", namespace, name)
        if obj is None:
            return None
        files = {key: value.encode() for key, value in (obj.get("data") or {}).items()}
        files.update({key: base64.b64decode(value) for key, value in (obj.get("binaryData") or {}).items()})
        return files

    def secret_files(self, namespace: str, name: str) -> dict[str, bytes] | None:
        obj = self._get("secrets", namespace, name)
        if obj is None:
            return None
        files = {key: base64.b64decode(value) for key, value in (obj.get("data") or {}).items()}
        files.update({key: value.encode() for key, value in (obj.get("stringData") or {}).items()})
        return files

    def config_map(self, namespace: str, name: str) -> dict[str, str] | None:
        files = self.config_map_files(namespace, name)
        return None if files is None else {k: v.decode(errors="replace") for k, v in files.items()}

    def secret(self, namespace: str, name: str) -> dict[str, str] | None:
        files = self.secret_files(namespace, name)
        return None if files is None else {k: v.decode(errors="replace") for k, v in files.items()}

    def token(self, audiences: list[str] | None = None, seconds: int = TOKEN_SECONDS) -> Token:
        """A token bound to the pod, reused until 80% of its lifetime has passed."""
        key = (tuple(audiences or ()), seconds)
        with self._lock:
            cached = self._tokens.get(key)
            if cached is None or cached.due_for_refresh():
                cached = self._tokens[key] = request_token(self._kube, self._pod, audiences, seconds)
            return cached

    def tokens_due(self) -> bool:
        with self._lock:
            return any(token.due_for_refresh() for token in self._tokens.values())
