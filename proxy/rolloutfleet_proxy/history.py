"""Conversation history fingerprints.

A session keeps no message text: it keeps the count of messages it has seen and a running digest of
them. Each turn the client sends the whole history (as OpenAI clients do); the recorded prefix must
match the digest, and only the messages after it are tokenized. This keeps memory per session small
and makes a client whose view diverged from the recorded trajectory fail loudly instead of silently.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import orjson

EMPTY_DIGEST = b"\x00" * 32
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_KEPT_FIELDS = ("name", "tool_calls", "tool_call_id")


class InvalidMessage(ValueError):
    pass


def message_text(content: Any) -> str:
    """Text of an OpenAI message content: a string or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if (
                not isinstance(part, Mapping)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise InvalidMessage("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidMessage("message content must be a string or a list of text parts")


def canonical_message(message: Any) -> dict[str, Any]:
    """The fields of a message that define the conversation, normalised (None fields dropped)."""
    if not isinstance(message, Mapping):
        raise InvalidMessage("each message must be a JSON object")
    role = message.get("role")
    if role not in ROLES:
        raise InvalidMessage(f"message role must be one of {sorted(ROLES)}, got {role!r}")
    canonical: dict[str, Any] = {"role": role, "content": message_text(message.get("content"))}
    for field in _KEPT_FIELDS:
        value = message.get(field)
        if value:
            canonical[field] = value
    return canonical


def extend_digest(digest: bytes, messages: Iterable[Mapping[str, Any]]) -> bytes:
    for message in messages:
        encoded = orjson.dumps(canonical_message(message), option=orjson.OPT_SORT_KEYS)
        digest = hashlib.blake2b(digest + encoded, digest_size=32).digest()
    return digest
