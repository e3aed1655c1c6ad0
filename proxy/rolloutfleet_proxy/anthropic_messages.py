"""Anthropic's Messages API as a dialect (`<session>/v1/messages`, where Anthropic's SDK posts).

A request becomes the chat messages it is equivalent to, then the internal turn through the chat
request's own validation (`parse_chat_request`), so a Messages history and its chat equivalent are
the same history in the session's tree:

| Messages | chat |
|---|---|
| `system` (a string or text blocks) | a first `system` message |
| user `text` / `image` blocks | a `user` message (text joined, images in place) |
| user `tool_result` blocks (content: a string, or text and image blocks; `is_error` accepted) | a `tool`
message each, before the user message of the other blocks |
| assistant `thinking` blocks (`signature` accepted, ignored) | `reasoning_content` |
| assistant `text` / `tool_use` blocks | `content` / `tool_calls` (input as the arguments object) |
| `tools` (`name`, `description`, `input_schema`) | function tools |
| `tool_choice` `auto` / `any` / `tool` / `none` | `auto` / `required` / the named function / `none` |
| `max_tokens` (required), `stop_sequences`, `temperature` (0-1), `top_p`, `top_k` | the same sampling |
| `thinking` `enabled` (`adaptive`, `between_tools`) / `disabled` | template keyword `enable_thinking` |

The answer is a `message` with `thinking`, `text` and `tool_use` blocks and `stop_reason`
(`tool_use`, `max_tokens`, `stop_sequence` with the matched `stop_sequence`, else `end_turn`), or
the event stream Anthropic's SDK reads (`message_start`, per block `content_block_start` / `_delta` /
`_stop`, `message_delta`, `message_stop`). Errors come in Anthropic's shape (`errors.error_body`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import orjson
from rolloutfleet_wire.errors import ErrorCode

from .dialects import Answered, ParsedTurn, RequestContext, sse_event
from .errors import ProxyError, bad_request, not_a_json_object
from .replies import Reply

ROLES = ("user", "assistant")
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
THINKING_TYPES = ("enabled", "adaptive", "between_tools", "disabled")  # Anthropic's; all but the last think


def _invalid(message: str) -> ProxyError:
    return bad_request(ErrorCode.INVALID_MESSAGES, message)


def _unsupported(where: str, kind: Any) -> ProxyError:
    return bad_request(
        ErrorCode.UNSUPPORTED_CONTENT,
        f"{where}: {kind!r} blocks are not supported here (user messages take text, image and tool_result "
        "blocks; assistant messages text, thinking and tool_use blocks)",
    )


def _text(block: Mapping[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise _invalid(f"{where}.text must be a string")
    return text


def _image(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    """An image block as a chat `image_url` part (a data URI, or the URL of a `url` source)."""
    source = block.get("source")
    if not isinstance(source, Mapping):
        raise _invalid(f"{where}.source must be an image source object")
    kind, url = source.get("type"), source.get("url")
    if kind == "base64":
        media, data = source.get("media_type"), source.get("data")
        if not isinstance(media, str) or not isinstance(data, str):
            raise _invalid(f"{where}.source needs a media_type and base64 data")
        return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}
    if kind == "url" and isinstance(url, str):
        return {"type": "image_url", "image_url": {"url": url}}
    raise _invalid(f"{where}.source must be a base64 or url image source")


def _blocks(content: Any, where: str) -> list[Mapping[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _invalid(f"{where} must be a string or a list of content blocks")
    for index, block in enumerate(content):
        if not isinstance(block, Mapping) or not isinstance(block.get("type"), str):
            raise _invalid(f"{where}[{index}] must be a content block object with a type")
    return content


def _tool_result_content(block: Mapping[str, Any], where: str) -> list[dict[str, Any]]:
    """Chat content parts (the chat request joins adjacent text parts)."""
    content = block.get("content")
    if content is None:
        return []
    parts: list[dict[str, Any]] = []
    for index, inner in enumerate(_blocks(content, f"{where}.content")):
        if inner["type"] == "text":
            parts.append({"type": "text", "text": _text(inner, f"{where}.content[{index}]")})
        elif inner["type"] == "image":
            parts.append(_image(inner, f"{where}.content[{index}]"))
        else:
            raise _unsupported(f"{where}.content[{index}]", inner["type"])
    return parts


def _user_messages(content: Any, where: str, open_calls: set[str]) -> list[dict[str, Any]]:
    """A user message as chat messages: its tool results first (one `tool` message each), then the
    rest as one user message."""
    tools: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for index, block in enumerate(_blocks(content, f"{where}.content")):
        at = f"{where}.content[{index}]"
        kind = block["type"]
        if kind == "text":
            parts.append({"type": "text", "text": _text(block, at)})
        elif kind == "image":
            parts.append(_image(block, at))
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not call_id:
                raise _invalid(f"{at}.tool_use_id must be a non-empty string")
            if call_id not in open_calls:
                raise bad_request(
                    ErrorCode.UNKNOWN_TOOL_CALL_ID,
                    f"{at}: tool_result names tool_use_id {call_id!r}, but the assistant message before it "
                    f"has no such tool_use (its tool_use ids: {', '.join(sorted(open_calls)) or 'none'})",
                )
            if not isinstance(block.get("is_error", False), bool):
                raise _invalid(f"{at}.is_error must be a boolean")
            tools.append(
                {"role": "tool", "tool_call_id": call_id, "content": _tool_result_content(block, at)}
            )
        else:
            raise _unsupported(at, kind)
    if parts or not tools:
        tools.append({"role": "user", "content": parts})
    return tools


def _assistant_message(content: Any, where: str) -> dict[str, Any]:
    text: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for index, block in enumerate(_blocks(content, f"{where}.content")):
        at = f"{where}.content[{index}]"
        kind = block["type"]
        if kind == "text":
            text.append(_text(block, at))
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise _invalid(f"{at}.thinking must be a string")
            thinking.append(block["thinking"])  # its signature is Anthropic's; nothing here checks it
        elif kind == "tool_use":
            call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not name:
                raise _invalid(f"{at} needs a non-empty id and name")
            if not isinstance(arguments, Mapping):
                raise _invalid(f"{at}.input must be an object")
            calls.append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            )
        else:
            raise _unsupported(at, kind)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    if calls:
        message["tool_calls"] = calls
    return message


def _system(system: Any) -> str | None:
    if system is None:
        return None
    if isinstance(system, str):
        return system
    blocks = _blocks(system, "system")
    if any(block["type"] != "text" for block in blocks):
        raise _invalid("system blocks must be text blocks")
    return "".join(_text(block, f"system[{i}]") for i, block in enumerate(blocks))


def chat_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The chat messages a Messages request is equivalent to (checked: roles, blocks, and tool results
    that answer a tool_use of the assistant message just before)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _invalid("messages must be a non-empty list")
    system = _system(body.get("system"))
    chat: list[dict[str, Any]] = [] if not system else [{"role": "system", "content": system}]
    open_calls: set[str] = set()
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        role = message.get("role") if isinstance(message, Mapping) else None
        if role not in ROLES:
            raise _invalid(f"{where}.role must be 'user' or 'assistant'")
        if role == "user":
            chat.extend(_user_messages(message.get("content"), where, open_calls))
            open_calls = set()
        else:
            assistant = _assistant_message(message.get("content"), where)
            open_calls = {call["id"] for call in assistant.get("tool_calls", ())}
            chat.append(assistant)
    if chat[-1]["role"] == "assistant":
        raise _invalid(
            "the last message must be a user message: prefilling the assistant's reply is not supported"
        )
    return chat


def _tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request(ErrorCode.INVALID_TOOLS, "tools must be a list")
    functions = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise bad_request(ErrorCode.INVALID_TOOLS, f"tools[{index}] must be an object")
        if tool.get("type", "custom") != "custom":
            raise bad_request(
                ErrorCode.UNSUPPORTED_PARAMETER,
                f"tools[{index}] is Anthropic's server tool {tool.get('type')!r}: only client tools (name, "
                "description, input_schema) are supported",
            )
        if "input_schema" not in tool:
            raise bad_request(ErrorCode.INVALID_TOOLS, f"tools[{index}].input_schema is required")
        function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if "description" in tool:
            function["description"] = tool["description"]
        functions.append({"type": "function", "function": function})
    return functions


def _tool_choice(choice: Any) -> str | dict[str, Any] | None:
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, Mapping) else None
    if isinstance(kind, str) and kind in TOOL_CHOICES:
        return TOOL_CHOICES[kind]
    if kind == "tool" and isinstance(choice.get("name"), str):  # type: ignore[union-attr]
        return {"type": "function", "function": {"name": choice["name"]}}  # type: ignore[index]
    raise bad_request(
        ErrorCode.INVALID_TOOL_CHOICE,
        'tool_choice must be {"type": "auto"}, {"type": "any"}, {"type": "none"} or '
        '{"type": "tool", "name": ...}',
    )


def _template_kwargs(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """`thinking` as the template keyword the thinking families read; `chat_template_kwargs` (an
    extension) wins."""
    given = body.get("chat_template_kwargs")
    thinking = body.get("thinking")
    if thinking is None:
        return given
    kind = thinking.get("type") if isinstance(thinking, Mapping) else None
    if kind not in THINKING_TYPES:
        raise bad_request(ErrorCode.INVALID_PARAMETER, f"thinking.type must be one of {list(THINKING_TYPES)}")
    if given is not None and not isinstance(given, Mapping):
        return given  # refused by the chat request's own check
    return {"enable_thinking": kind != "disabled", **(given or {})}


def _max_tokens(body: Mapping[str, Any]) -> int:
    value = body.get("max_tokens")
    if value is None:
        raise bad_request(
            ErrorCode.INVALID_PARAMETER, "max_tokens is required (as Anthropic's API requires it)"
        )
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise bad_request(ErrorCode.INVALID_PARAMETER, "max_tokens must be a positive integer")
    return value


class MessagesDialect:
    paths: tuple[str, ...] = ("/v1/messages",)

    def parse(self, body: Any, context: RequestContext) -> ParsedTurn:
        if not isinstance(body, dict):
            raise not_a_json_object()
        chat: dict[str, Any] = {"messages": chat_messages(body), "max_tokens": _max_tokens(body)}
        temperature = body.get("temperature")  # Anthropic's range; its type is checked with chat's
        if (
            isinstance(temperature, int | float)
            and not isinstance(temperature, bool)
            and not 0 <= temperature <= 1  # NaN too
        ):
            raise bad_request(ErrorCode.INVALID_PARAMETER, "temperature must be between 0 and 1")
        for name in ("temperature", "top_p", "top_k"):
            if body.get(name) is not None:
                chat[name] = body[name]
        stop = body.get("stop_sequences")
        if stop is not None:
            if not isinstance(stop, list):
                raise bad_request(ErrorCode.INVALID_PARAMETER, "stop_sequences must be a list of strings")
            chat["stop"] = stop
        tools = _tools(body)
        if tools:
            chat["tools"] = tools
        choice = _tool_choice(body.get("tool_choice"))
        if choice is not None:
            chat["tool_choice"] = choice
        kwargs = _template_kwargs(body)
        if kwargs is not None:
            chat["chat_template_kwargs"] = kwargs
        chat["stream"] = body.get("stream", False)  # checked with the chat request
        request = context.one_sample_turn(chat)
        return ParsedTurn(request)

    def answer(self, answered: Answered) -> bytes | Iterator[bytes]:
        message = message_of(answered)
        if answered.parsed.request.stream:
            return message_events(message)
        return orjson.dumps(message)


def content_blocks(reply: Reply) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if reply.reasoning is not None:
        blocks.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
    if reply.content:
        blocks.append({"type": "text", "text": reply.content})
    for call in reply.tool_calls:
        function = call["function"]
        blocks.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": function["name"],
                "input": orjson.loads(function["arguments"]),
            }
        )
    return blocks


def stop_reason(finish: str, stop_string: str | None, reply: Reply) -> str:
    if reply.tool_calls:
        return "tool_use"
    if finish == "length":
        return "max_tokens"
    return "stop_sequence" if stop_string is not None else "end_turn"


def message_of(answered: Answered) -> dict[str, Any]:
    """The recorded turn as an Anthropic `message` (one choice: Messages has no `n`)."""
    result = answered.result
    (choice,) = result.choices
    reason = stop_reason(choice.finish, choice.stop_string, choice.reply)
    return {
        "id": f"msg_{answered.session_id}_{result.call}",
        "type": "message",
        "role": "assistant",
        "model": answered.model,
        "content": content_blocks(choice.reply),
        "stop_reason": reason,
        "stop_sequence": choice.stop_string if reason == "stop_sequence" else None,
        "usage": {"input_tokens": result.prompt_tokens, "output_tokens": len(choice.output_ids)},
        "rolloutfleet": {"session_id": answered.session_id, "turn": result.call},
    }


def message_events(message: dict[str, Any]) -> Iterator[bytes]:
    """The recorded message as Anthropic's event stream: each block whole in one delta."""
    start = {
        **message,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": message["usage"]["input_tokens"], "output_tokens": 0},
    }
    del start["rolloutfleet"]
    yield sse_event("message_start", {"type": "message_start", "message": start})
    for index, block in enumerate(message["content"]):
        kind = block["type"]
        opened: dict[str, Any]
        if kind == "thinking":
            opened = {"type": "thinking", "thinking": "", "signature": ""}
            deltas = [
                {"type": "thinking_delta", "thinking": block["thinking"]},
                {"type": "signature_delta", "signature": block["signature"]},
            ]
        elif kind == "text":
            opened = {"type": "text", "text": ""}
            deltas = [{"type": "text_delta", "text": block["text"]}]
        else:
            opened = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            deltas = [{"type": "input_json_delta", "partial_json": orjson.dumps(block["input"]).decode()}]
        yield sse_event(
            "content_block_start", {"type": "content_block_start", "index": index, "content_block": opened}
        )
        for delta in deltas:
            yield sse_event(
                "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
            )
        yield sse_event("content_block_stop", {"type": "content_block_stop", "index": index})
    yield sse_event(
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]},
            "usage": {"output_tokens": message["usage"]["output_tokens"]},
            "rolloutfleet": message["rolloutfleet"],
        },
    )
    yield sse_event("message_stop", {"type": "message_stop"})
