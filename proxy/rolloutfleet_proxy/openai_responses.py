"""OpenAI's Responses API as a dialect (`<session>/responses`, where the openai SDK posts).

The input items become the chat messages they are equivalent to, then the internal turn through the
chat request's own validation (`parse_chat_request`), so a Responses history and its chat equivalent
are the same history in the session's tree:

| Responses | chat |
|---|---|
| `instructions` | a first `system` message (not with `previous_response_id`: see below) |
| `input` as a string | one `user` message |
| message items (`input_text`, `input_image`, `output_text`, `refusal` parts) | a message of that role |
| a `reasoning` item (its `reasoning_text` content, else its summary) | `reasoning_content` of the
assistant message after it |
| `function_call` items | `tool_calls` of the assistant message they follow |
| `function_call_output` items | `tool` messages |
| function `tools`, `tool_choice`, `max_output_tokens`, `temperature`, `top_p` | the same |

A response's id names its recorded turn (`resp_<session>_<turn>`). `previous_response_id` continues
that turn's reply: the input holds only what follows it (tool outputs answering its calls, a new user
message), and the turn's recorded ids are kept as they are, so `instructions` (and a change of tools)
are not re-rendered into them. An id that names no delivered turn of the session is 400
`previous_response_not_found`. `store` is accepted (every turn is recorded anyway).

The answer is a `response` with `reasoning`, `message` and `function_call` output items, `usage`,
and `status` `incomplete` (with `incomplete_details.reason` `max_output_tokens`) when the reply ran
out of tokens; streamed as the events the openai SDK's `responses.stream` reads.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator, Mapping
from typing import Any

import orjson
from rolloutfleet_wire.errors import ErrorCode

from .dialects import Answered, ParsedTurn, RequestContext, sse_event
from .errors import ProxyError, bad_request, not_a_json_object
from .replies import Reply

MESSAGE_ROLES = frozenset({"user", "assistant", "system", "developer"})
TOOL_CHOICE_MODES = frozenset({"auto", "none", "required"})
_TURN = re.compile(r"[0-9]{1,10}")


def response_id(session_id: str, turn: int) -> str:
    return f"resp_{session_id}_{turn}"


def previous_turn(value: Any, session_id: str) -> int | None:
    """The turn a `previous_response_id` names (None without one); 400 for an id of no turn here."""
    if value is None:
        return None
    prefix = f"resp_{session_id}_"
    if isinstance(value, str) and value.startswith(prefix) and _TURN.fullmatch(value[len(prefix) :]):
        return int(value[len(prefix) :])
    raise bad_request(
        ErrorCode.PREVIOUS_RESPONSE_NOT_FOUND,
        f"previous_response_id {value!r} names no response of this session (its ids are {prefix}<turn>)",
    )


def _invalid(message: str) -> ProxyError:
    return bad_request(ErrorCode.INVALID_MESSAGES, message)


def _unsupported(where: str, kind: Any) -> ProxyError:
    return bad_request(
        ErrorCode.UNSUPPORTED_CONTENT,
        f"{where}: {kind!r} is not supported here (input takes message, reasoning, function_call and "
        "function_call_output items; messages take input_text, input_image, output_text and refusal parts)",
    )


def _parts(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message item's content as chat content: its text, or its text and image parts in order (the
    chat request joins adjacent text parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _invalid(f"{where}.content must be a string or a list of content parts")
    parts: list[dict[str, Any]] = []
    for index, part in enumerate(content):
        at = f"{where}.content[{index}]"
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in ("input_text", "output_text", "refusal"):
            text = part.get("refusal" if kind == "refusal" else "text")  # type: ignore[union-attr]
            if not isinstance(text, str):
                raise _invalid(f"{at} needs its text as a string")
            parts.append({"type": "text", "text": text})
        elif kind == "input_image":
            url = part.get("image_url")  # type: ignore[union-attr]
            if not isinstance(url, str) or not url:
                raise _unsupported(at, "an input_image without an image_url (file ids)")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise _unsupported(at, kind)
    return parts


def _reasoning_text(item: Mapping[str, Any], where: str) -> str:
    """The reasoning's own text if the item has it, else its summary (empty when encrypted only)."""
    for field, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        pieces = item.get(field) or []
        if not isinstance(pieces, list):
            raise _invalid(f"{where}.{field} must be a list")
        texts: list[str] = []
        for piece in pieces:
            if isinstance(piece, Mapping) and piece.get("type") == kind:
                if not isinstance(piece.get("text"), str):
                    raise _invalid(f"{where}.{field} texts must be strings")
                texts.append(piece["text"])
        if texts:
            return "".join(texts)
    return ""


class _Assembler:
    """Consecutive reasoning, assistant message and function_call items as one assistant message."""

    def __init__(self, after_previous: bool):
        self.messages: list[dict[str, Any]] = []
        self.assistant: dict[str, Any] | None = None
        self.open_calls: set[str] = set()
        self.leading = after_previous  # outputs before anything else answer the previous response

    def _current(self) -> dict[str, Any]:
        if self.assistant is None:
            self.assistant = {"role": "assistant", "content": ""}
        return self.assistant

    def close(self) -> None:
        if self.assistant is not None:
            self.open_calls = {call["id"] for call in self.assistant.get("tool_calls", ())}
            self.messages.append(self.assistant)
            self.assistant = None

    def item(self, item: Any, where: str) -> None:
        if not isinstance(item, Mapping):
            raise _invalid(f"{where} must be an object")
        kind = item.get("type", "message")
        if kind != "function_call_output":
            self.leading = False
        if kind == "message":
            role = item.get("role")
            if not isinstance(role, str) or role not in MESSAGE_ROLES:
                raise _invalid(f"{where}.role must be one of {sorted(MESSAGE_ROLES)}")
            content = _parts(item.get("content"), where)
            if role == "assistant":
                if self.assistant is not None and (
                    self.assistant["content"] or "tool_calls" in self.assistant
                ):
                    self.close()
                self._current()["content"] = content
                return
            self.close()
            self.open_calls = set()
            self.messages.append({"role": role, "content": content})
        elif kind == "reasoning":  # opens the next assistant message (consecutive ones join)
            if self.assistant is not None and (self.assistant["content"] or "tool_calls" in self.assistant):
                self.close()
            text = _reasoning_text(item, where)
            if text:  # an empty one (encrypted, or without a summary) adds nothing
                current = self._current()
                current["reasoning_content"] = current.get("reasoning_content", "") + text
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
            if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not name:
                raise _invalid(f"{where} needs a non-empty call_id and name")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            self._current().setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            self.close()
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not call_id:
                raise _invalid(f"{where}.call_id must be a non-empty string")
            if not self.leading and call_id not in self.open_calls:
                raise bad_request(
                    ErrorCode.UNKNOWN_TOOL_CALL_ID,
                    f"{where}: function_call_output answers call_id {call_id!r}, but no function_call item "
                    f"before it made that call (open calls: {', '.join(sorted(self.open_calls)) or 'none'})",
                )
            content = output if isinstance(output, str) else _parts(output, where)
            self.messages.append({"role": "tool", "tool_call_id": call_id, "content": content})
        else:
            raise _unsupported(where, kind)


def chat_messages(body: Mapping[str, Any], after_previous: bool) -> list[dict[str, Any]]:
    """The chat messages `input` (and, on a first request, `instructions`) are equivalent to."""
    items = body.get("input")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _invalid("instructions must be a string")
    head = [] if after_previous or not instructions else [{"role": "system", "content": instructions}]
    if isinstance(items, str):
        return [*head, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise _invalid("input must be a string or a non-empty list of items")
    assembler = _Assembler(after_previous)
    for index, item in enumerate(items):
        assembler.item(item, f"input[{index}]")
    assembler.close()
    return [*head, *assembler.messages]


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request(ErrorCode.INVALID_TOOLS, "tools must be a list")
    functions = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, Mapping) else tool
            raise bad_request(
                ErrorCode.UNSUPPORTED_PARAMETER,
                f"tools[{index}] is a {kind!r} tool: only function tools are supported",
            )
        function = {
            k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None
        }
        functions.append({"type": "function", "function": function})
    return functions


def _tool_choice(choice: Any) -> str | dict[str, Any] | None:
    if choice is None or (isinstance(choice, str) and choice in TOOL_CHOICE_MODES):
        return choice
    if (
        isinstance(choice, Mapping)
        and choice.get("type") == "function"
        and isinstance(choice.get("name"), str)
    ):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request(
        ErrorCode.INVALID_TOOL_CHOICE,
        'tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}',
    )


def _check_options(body: Mapping[str, Any]) -> None:
    """The options that change nothing here are checked (they are echoed); those that would are refused."""
    text = body.get("text")
    form = text.get("format") if isinstance(text, Mapping) else None
    if isinstance(form, Mapping) and form.get("type", "text") != "text":
        raise bad_request(ErrorCode.UNSUPPORTED_PARAMETER, "text.format: only plain text output is supported")
    if body.get("background"):
        raise bad_request(ErrorCode.UNSUPPORTED_PARAMETER, "background responses are not supported")
    if body.get("conversation") is not None:
        raise bad_request(
            ErrorCode.UNSUPPORTED_PARAMETER,
            "conversation is not supported: a session is the conversation (or use previous_response_id)",
        )
    for name in ("store", "parallel_tool_calls"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise bad_request(ErrorCode.INVALID_PARAMETER, f"{name} must be a boolean")
    metadata = body.get("metadata")
    if metadata is not None and not (
        isinstance(metadata, Mapping) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise bad_request(ErrorCode.INVALID_PARAMETER, "metadata must be an object of strings")


class ResponsesDialect:
    # The openai SDK posts to `<base URL>/responses`, and a session's base URL ends in its id; a client
    # configured with the API root as in OpenAI's docs posts to `<base URL>/v1/responses`: both work.
    paths: tuple[str, ...] = ("/responses", "/v1/responses")

    def parse(self, body: Any, context: RequestContext) -> ParsedTurn:
        if not isinstance(body, dict):
            raise not_a_json_object()
        _check_options(body)
        previous = previous_turn(body.get("previous_response_id"), context.session_id)
        chat: dict[str, Any] = {"messages": chat_messages(body, previous is not None)}
        if body.get("max_output_tokens") is not None:
            chat["max_tokens"] = body["max_output_tokens"]
        for name in ("temperature", "top_p", "top_k", "chat_template_kwargs"):
            if body.get(name) is not None:
                chat[name] = body[name]
        tools = _tools(body.get("tools"))
        if tools:
            chat["tools"] = tools
        choice = _tool_choice(body.get("tool_choice"))
        if choice is not None:
            chat["tool_choice"] = choice
        chat["stream"] = body.get("stream", False)  # checked with the chat request
        request = context.one_sample_turn(chat, previous)
        temperature, top_p = request.sampling_params.get("temperature"), request.sampling_params.get("top_p")
        echo = {
            "instructions": body.get("instructions"),
            "max_output_tokens": request.sampling_params["max_new_tokens"],
            "metadata": body.get("metadata") or {},
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"),
            "store": body.get("store", True),
            "temperature": 1.0 if temperature is None else temperature,
            "text": {"format": {"type": "text"}},
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [],
            "top_p": 1.0 if top_p is None else top_p,
            "truncation": "disabled",
        }
        return ParsedTurn(request, echo)

    def answer(self, answered: Answered) -> bytes | Iterator[bytes]:
        response = response_of(answered)
        if answered.parsed.request.stream:
            return response_events(response)
        return orjson.dumps(response)


def output_items(reply: Reply, item_id: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if reply.reasoning is not None:
        items.append(
            {
                "type": "reasoning",
                "id": f"rs_{item_id}",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": reply.reasoning}],
                "status": "completed",
            }
        )
    if reply.content or not reply.tool_calls:
        items.append(
            {
                "type": "message",
                "id": f"msg_{item_id}",
                "role": "assistant",
                "status": "completed",
                "content": [
                    {"type": "output_text", "text": reply.content, "annotations": [], "logprobs": []}
                ],
            }
        )
    for index, call in enumerate(reply.tool_calls):
        function = call["function"]
        items.append(
            {
                "type": "function_call",
                "id": f"fc_{item_id}_{index}",
                "call_id": call["id"],
                "name": function["name"],
                "arguments": function["arguments"],
                "status": "completed",
            }
        )
    return items


def response_of(answered: Answered) -> dict[str, Any]:
    """The recorded turn as a `response` object (one choice: Responses has no `n`)."""
    result = answered.result
    (choice,) = result.choices
    incomplete = choice.finish == "length" and not choice.reply.tool_calls
    output_tokens = len(choice.output_ids)
    return {
        "id": response_id(answered.session_id, result.call),
        "object": "response",
        "created_at": answered.created,
        "model": answered.model,
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None,
        "output": output_items(choice.reply, f"{answered.session_id}_{result.call}"),
        "usage": {
            "input_tokens": result.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": result.prompt_tokens + output_tokens,
        },
        **answered.parsed.echo,
        "rolloutfleet": {"session_id": answered.session_id, "turn": result.call},
    }


def response_events(response: dict[str, Any]) -> Iterator[bytes]:
    """The recorded response as the Responses event stream: each item whole in one delta."""
    sequence = itertools.count()

    def event(kind: str, **data: Any) -> bytes:
        return sse_event(kind, {"type": kind, "sequence_number": next(sequence), **data})

    started = {**response, "status": "in_progress", "incomplete_details": None, "output": [], "usage": None}
    yield event("response.created", response=started)
    yield event("response.in_progress", response=started)
    for index, item in enumerate(response["output"]):
        kind, item_id = item["type"], item["id"]
        where = {"item_id": item_id, "output_index": index}
        if kind == "reasoning":
            text = item["content"][0]["text"]
            yield event("response.output_item.added", output_index=index, item={**item, "content": []})
            yield event("response.reasoning_text.delta", **where, content_index=0, delta=text)
            yield event("response.reasoning_text.done", **where, content_index=0, text=text)
        elif kind == "message":
            part = item["content"][0]
            added = {**item, "status": "in_progress", "content": []}
            yield event("response.output_item.added", output_index=index, item=added)
            yield event("response.content_part.added", **where, content_index=0, part={**part, "text": ""})
            yield event(
                "response.output_text.delta", **where, content_index=0, delta=part["text"], logprobs=[]
            )
            yield event("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[])
            yield event("response.content_part.done", **where, content_index=0, part=part)
        else:
            added = {**item, "arguments": "", "status": "in_progress"}
            yield event("response.output_item.added", output_index=index, item=added)
            yield event("response.function_call_arguments.delta", **where, delta=item["arguments"])
            yield event(
                "response.function_call_arguments.done",
                **where,
                name=item["name"],
                arguments=item["arguments"],
            )
        yield event("response.output_item.done", output_index=index, item=item)
    final = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    yield event(final, response=response)
