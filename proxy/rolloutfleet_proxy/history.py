"""Conversation history fingerprints, and the canonical form of the messages they cover.

A session keeps no message text: it keeps the count of messages it has seen and a running digest of
them. Each turn the client sends the whole history (as OpenAI clients do); the recorded prefix must
match the digest, and only the messages after it are tokenized. This keeps memory per session small
and makes a client whose view diverged from the recorded trajectory fail loudly instead of silently.

The digest covers what defines the conversation: role, content (an image by the sha256 of its bytes),
name, tool calls (function name and arguments, compared as JSON values so key order and spacing do
not matter) and the call a tool message answers. It leaves out `reasoning_content`: clients may send
it back or drop it, and the recorded ids hold the reasoning the model generated either way.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import orjson
from rolloutfleet_wire.session_record import EMPTY_DIGEST

from .images import UNSUPPORTED_PARTS, image_part_source

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
# Deep enough for any real tool arguments, shallow enough that serializing them cannot hit orjson's
# recursion limit (which would be a 500).
MAX_JSON_DEPTH = 64


# Messages whose content may hold images (as vision-language chat templates render them).
IMAGE_ROLES = frozenset({"user", "tool"})
IMAGE_PART = "image"  # a canonical image part: {"type": "image", "image": ImageSource | sha256 hex}


class InvalidMessage(ValueError):
    pass


class UnsupportedContent(InvalidMessage):
    """A content part the proxy does not take (video, audio, files)."""


def message_content(content: Any, role: str) -> str | list[dict[str, Any]]:
    """An OpenAI message content in canonical form: its text, or, when it holds images, its parts in
    order (adjacent text parts joined, empty ones dropped; an image part holds its source until its
    bytes are decoded, then its sha256 in hex)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidMessage("message content must be a string or a list of content parts")
    parts: list[dict[str, Any]] = []
    text: list[str] = []
    for index, part in enumerate(content):
        where = f"content[{index}]"
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text" and isinstance(part.get("text"), str):  # type: ignore[union-attr]
            text.append(part["text"])  # type: ignore[index]
            continue
        if kind == "image_url":
            if role not in IMAGE_ROLES:
                raise InvalidMessage(f"{where}: images are taken in user and tool messages only")
            try:
                source = image_part_source(dict(part), where)  # type: ignore[arg-type]
            except ValueError as exc:
                raise InvalidMessage(str(exc)) from None
            if text:
                parts.append({"type": "text", "text": "".join(text)})
                text = []
            parts.append({"type": IMAGE_PART, "image": source})
            continue
        if kind in UNSUPPORTED_PARTS:
            raise UnsupportedContent(
                f"{where}: {kind} parts are not supported: this proxy takes text and images (video and "
                "audio are refused)"
            )
        raise InvalidMessage(f"{where}: a content part must be text or image_url")
    joined = "".join(text)
    if not parts:
        return joined
    if joined:
        parts.append({"type": "text", "text": joined})
    return parts


def message_text(content: str | list[dict[str, Any]]) -> str:
    """The text of a canonical content (images left out)."""
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content if part["type"] == "text")


def image_parts(messages: Iterable[Mapping[str, Any]]) -> Iterator[dict[str, Any]]:
    """The image parts of canonical messages, in order."""
    for message in messages:
        content = message["content"]
        if type(content) is not str:
            for part in content:
                if part["type"] == IMAGE_PART:
                    yield part


def json_depth_within(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when the JSON value nests no deeper than `limit` (iterative: no recursion of our own)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > limit:
                return False
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return True


def parse_arguments(arguments: Any, where: str) -> dict[str, Any]:
    """Tool-call arguments as a JSON object: OpenAI sends a JSON string, templates want the object."""
    if isinstance(arguments, str):
        try:
            arguments = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            raise InvalidMessage(f"{where}: arguments must be a JSON object encoded as a string") from None
    if not isinstance(arguments, dict):
        raise InvalidMessage(f"{where}: arguments must be a JSON object")
    if not json_depth_within(arguments):
        raise InvalidMessage(f"{where}: arguments nest deeper than {MAX_JSON_DEPTH} levels")
    return arguments


def canonical_tool_calls(tool_calls: Any) -> list[dict[str, Any]]:
    if not isinstance(tool_calls, list):
        raise InvalidMessage("tool_calls must be a list")
    canonical = []
    for index, call in enumerate(tool_calls):
        where = f"tool_calls[{index}]"
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping):
            raise InvalidMessage(f"{where} must be an object with a function object")
        call_id, name = call.get("id"), function.get("name")
        if not isinstance(call_id, str) or not call_id:
            raise InvalidMessage(f"{where}.id must be a non-empty string")
        if call.get("type", "function") != "function":
            raise InvalidMessage(f"{where}.type must be 'function'")
        if not isinstance(name, str) or not name:
            raise InvalidMessage(f"{where}.function.name must be a non-empty string")
        arguments = parse_arguments(function.get("arguments", "{}"), f"{where}.function")
        canonical.append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        )
    return canonical


def canonical_message(message: Any) -> dict[str, Any]:
    """The fields of a message that define the conversation, normalised (None fields dropped).

    `reasoning_content` is kept when present (the template may render it) but is not part of the
    digest (see `digest_fields`). Runs for every message of every turn: plain dict checks first."""
    if not isinstance(message, dict):
        if not isinstance(message, Mapping):
            raise InvalidMessage("each message must be a JSON object")
        message = dict(message)
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise InvalidMessage(f"message role must be one of {sorted(ROLES)}, got {role!r}")
    content = message.get("content")
    canonical: dict[str, Any] = {
        "role": role,
        "content": content if type(content) is str else message_content(content, role),
    }
    if len(message) > 1 + ("content" in message):  # fields beyond role and content
        name = message.get("name")
        if name:
            if not isinstance(name, str):
                raise InvalidMessage("message name must be a string")
            canonical["name"] = name
        tool_calls = message.get("tool_calls")
        if tool_calls:
            if role != "assistant":
                raise InvalidMessage("only assistant messages carry tool_calls")
            canonical["tool_calls"] = canonical_tool_calls(tool_calls)
        reasoning = message.get("reasoning_content")
        if reasoning:
            if role != "assistant" or not isinstance(reasoning, str):
                raise InvalidMessage("reasoning_content must be a string on an assistant message")
            canonical["reasoning_content"] = reasoning
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise InvalidMessage("a tool message needs the tool_call_id of the call it answers")
        canonical["tool_call_id"] = call_id
    return canonical


def digest_fields(canonical: Mapping[str, Any]) -> Mapping[str, Any]:
    if "reasoning_content" not in canonical:
        return canonical
    return {k: v for k, v in canonical.items() if k != "reasoning_content"}


def extend_digest(digest: bytes, messages: Iterable[Mapping[str, Any]]) -> bytes:
    """The digest after `messages` (any form: they are canonicalized first)."""
    return extend_canonical_digest(digest, (canonical_message(m) for m in messages))


def extend_canonical_digest(digest: bytes, messages: Iterable[Mapping[str, Any]]) -> bytes:
    """The digest after messages already in canonical form (`canonical_message`'s output)."""
    for message in messages:
        encoded = orjson.dumps(digest_fields(message), option=orjson.OPT_SORT_KEYS)
        digest = hashlib.blake2b(digest + encoded, digest_size=32).digest()
    return digest


def tools_digest(tools: list[dict[str, Any]] | None) -> bytes:
    """The digest a session's history starts from: its tools are part of its first prompt, so a
    later turn with other tools does not match. No tools: the empty digest (older dumps agree)."""
    if not tools:
        return EMPTY_DIGEST
    encoded = orjson.dumps(tools, option=orjson.OPT_SORT_KEYS)
    return hashlib.blake2b(b"tools\x00" + encoded, digest_size=32).digest()
