"""The generated admin-key Secret (only when the spec names none): its value is random, so the
reconciler creates it once and never re-applies it."""

from __future__ import annotations

from ..fleet import Fleet
from .metadata import Manifest, object_metadata


def admin_key_secret(fleet: Fleet, key: str) -> Manifest:
    """The Secret holding `key`, which the caller generates."""
    ref = fleet.admin_key_ref
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": object_metadata(fleet, ref.name, "proxy"),
        "type": "Opaque",
        "stringData": {ref.key: key},
    }
