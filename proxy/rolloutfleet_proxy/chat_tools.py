"""The tool side of a chat request: `tools`, `tool_choice`, and tool results that answer real calls.

Pure validation: bad input becomes a 400 with a message that says what is wrong, before anything is
rendered or sent upstream.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from jsonschema import exceptions as schema_errors
from jsonschema.validators import validator_for
from rolloutfleet_wire.errors import ErrorCode

from .errors import ProxyError, bad_request
from .history import json_depth_within

# OpenAI's rule for function names.
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
TOOL_CHOICE_MODES = ("auto", "none", "required")
MAX_TOOLS = 128
# Schema checks cost milliseconds; a session sends the same tools every turn.
_VALID_SCHEMAS: OrderedDict[bytes, None] = OrderedDict()
_VALID_SCHEMAS_MAX = 512


@dataclass(frozen=True)
class ToolSpec:
    """A request's tools: as the template receives them, and their names."""

    tools: list[dict[str, Any]]  # [{"type": "function", "function": {name, description?, parameters?}}]
    names: frozenset[str]
    choice: str | dict[str, Any]  # "auto" | "none" | "required" | {"type": "function", "function": {...}}
    parallel: bool = True  # OpenAI's parallel_tool_calls: false allows one call per reply

    @property
    def rendered(self) -> list[dict[str, Any]] | None:
        """What the chat template is given: nothing when the request says tool_choice "none"."""
        return None if self.choice == "none" else self.tools

    @property
    def parse_calls(self) -> bool:
        return self.choice != "none"

    @property
    def forces_call(self) -> bool:
        """tool_choice "required" or a named function: the reply must be a call (`tool_grammar.py`)."""
        return self.choice == "required" or isinstance(self.choice, dict)

    @property
    def forced_name(self) -> str | None:
        return self.choice["function"]["name"] if isinstance(self.choice, dict) else None


def invalid_tools(message: str) -> ProxyError:
    return bad_request(ErrorCode.INVALID_TOOLS, message)


def _check_schema(schema: Any, where: str) -> None:
    if not isinstance(schema, dict):
        raise invalid_tools(f"{where} must be a JSON schema object")
    if not json_depth_within(schema):
        raise invalid_tools(f"{where} nests too deep")
    key = orjson.dumps(schema, option=orjson.OPT_SORT_KEYS)
    if key in _VALID_SCHEMAS:
        _VALID_SCHEMAS.move_to_end(key)
        return
    try:
        validator_for(schema).check_schema(schema)
    except schema_errors.SchemaError as exc:
        path = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise invalid_tools(f"{where} is not a valid JSON schema at {path}: {exc.message}") from None
    except (schema_errors.UnknownType, ValueError, TypeError, RecursionError) as exc:
        raise invalid_tools(f"{where} is not a valid JSON schema: {exc}") from None
    if schema.get("type", "object") != "object":
        raise invalid_tools(f"{where} must describe an object (type 'object')")
    _VALID_SCHEMAS[key] = None
    if len(_VALID_SCHEMAS) > _VALID_SCHEMAS_MAX:
        _VALID_SCHEMAS.popitem(last=False)


def _tool(tool: Any, index: int) -> dict[str, Any]:
    where = f"tools[{index}]"
    if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
        raise invalid_tools(f"{where} must be an object of type 'function'")
    function = tool.get("function")
    if not isinstance(function, Mapping):
        raise invalid_tools(f"{where}.function must be an object")
    name = function.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise invalid_tools(f"{where}.function.name must be 1-64 letters, digits, '_' or '-'")
    clean: dict[str, Any] = {"name": name}
    description = function.get("description")
    if description is not None:
        if not isinstance(description, str):
            raise invalid_tools(f"{where}.function.description must be a string")
        clean["description"] = description
    parameters = function.get("parameters")
    if parameters is not None:
        _check_schema(parameters, f"{where}.function.parameters")
        clean["parameters"] = parameters
    strict = function.get("strict")
    if strict is not None:
        if not isinstance(strict, bool):
            raise invalid_tools(f"{where}.function.strict must be a boolean")
        clean["strict"] = strict
    return {"type": "function", "function": clean}


def parse_tools(body: Mapping[str, Any]) -> ToolSpec | None:
    """`tools` and `tool_choice` of a request (None without tools); 400 on anything malformed."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    if raw is None or raw == []:
        if choice not in (None, "none", "auto"):
            raise bad_request(ErrorCode.INVALID_TOOL_CHOICE, "tool_choice needs tools")
        return None
    if not isinstance(raw, list):
        raise invalid_tools("tools must be a list of function tools")
    if len(raw) > MAX_TOOLS:
        raise invalid_tools(f"at most {MAX_TOOLS} tools")
    tools = [_tool(tool, i) for i, tool in enumerate(raw)]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise invalid_tools("tool function names must be unique")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad_request(ErrorCode.INVALID_PARAMETER, "parallel_tool_calls must be a boolean")
    return ToolSpec(tools, frozenset(names), _tool_choice(choice, frozenset(names)), parallel)


def _tool_choice(choice: Any, names: frozenset[str]) -> str | dict[str, Any]:
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in TOOL_CHOICE_MODES:
            raise bad_request(
                ErrorCode.INVALID_TOOL_CHOICE, f"tool_choice must be one of {list(TOOL_CHOICE_MODES)}"
            )
        return choice
    function = choice.get("function") if isinstance(choice, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str) or choice.get("type", "function") != "function":  # type: ignore[union-attr]
        raise bad_request(
            ErrorCode.INVALID_TOOL_CHOICE,
            'tool_choice must be "auto", "none", "required" or '
            '{"type": "function", "function": {"name": ...}}',
        )
    if name not in names:
        raise bad_request(
            ErrorCode.INVALID_TOOL_CHOICE, f"tool_choice names {name!r}, which is not among the tools"
        )
    return {"type": "function", "function": {"name": name}}


def check_tool_results(messages: Sequence[Mapping[str, Any]], after_recorded_reply: bool = False) -> None:
    """Every tool message answers a call of the last assistant message before it. After a recorded
    reply (`after_recorded_reply`), the tool messages that open `messages` answer that reply's calls:
    the turn checks those."""
    open_calls: set[str] = set()
    for index, message in enumerate(messages):
        role = message["role"]
        if after_recorded_reply:
            if role == "tool":
                continue
            after_recorded_reply = False
        if role == "assistant":
            open_calls = {call["id"] for call in message.get("tool_calls", ())}
        elif role == "tool":
            call_id = message["tool_call_id"]
            if call_id not in open_calls:
                known = ", ".join(sorted(open_calls)) or "none"
                raise bad_request(
                    ErrorCode.UNKNOWN_TOOL_CALL_ID,
                    f"messages[{index}] answers tool call {call_id!r}, but the assistant message before "
                    f"it made no such call (its calls: {known})",
                )
        elif role == "user":
            open_calls = set()


RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "return_dict",
        "return_tensors",
        "chat_template",
        "tokenizer_kwargs",
        "padding",
        "truncation",
        "max_length",
        "return_assistant_tokens_mask",
    }
)


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")  # OpenAI's values


def template_kwargs(body: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The proxy's default `chat_template_kwargs` overridden key by key by the request's. OpenAI's
    `reasoning_effort` goes to the template as a keyword too (gpt-oss's writes it into its system
    message), below the request's own `chat_template_kwargs`, as SGLang passes it."""
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise bad_request(
            ErrorCode.INVALID_PARAMETER, f"reasoning_effort must be one of {list(REASONING_EFFORTS)}"
        )
    given = body.get("chat_template_kwargs")
    if given is None:
        given = {}
    if not isinstance(given, Mapping):
        raise bad_request(ErrorCode.INVALID_PARAMETER, "chat_template_kwargs must be a JSON object")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(given))
    if reserved:
        raise bad_request(ErrorCode.INVALID_PARAMETER, f"chat_template_kwargs may not set {reserved}")
    if not json_depth_within(dict(given), 16):
        raise bad_request(ErrorCode.INVALID_PARAMETER, "chat_template_kwargs nests too deep")
    return {**defaults, **({} if effort is None else {"reasoning_effort": effort}), **given}
