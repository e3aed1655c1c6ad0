"""EBNF for JSON values a JSON schema allows, in the grammar dialect SGLang's default backend (xgrammar)
compiles: the argument part of a forced tool call (`tool_grammar.py`).

Like SGLang's `EBNFComposer` (python/sglang/srt/function_call/ebnf_composer.py), the JSON is written in
one fixed layout, the one `json.dumps` writes (`", "` between items, `": "` after keys, no other
whitespace): a model cannot wander into endless whitespace, and the arguments read back unchanged.
Object properties come in the schema's order, each required one present, no others.

What a schema says is expressed where it shapes the text: `type` (one or a list), `properties` and
`required`, `items` with `minItems`/`maxItems`, `minLength`/`maxLength` of strings, `enum`, `const`,
`anyOf`/`oneOf` (as alternatives). Keywords about values rather than shapes (`minimum`, `pattern`,
`format`, `multipleOf`, `uniqueItems`, ...) are not enforced, and a subschema the grammar cannot follow
(`$ref`, `allOf`, `not`, conditionals, an object without `properties`) becomes any JSON value of the
right type (any value when no type is given).

Pure: a function of the schema; rule names are numbered from a prefix, so two schemas in one grammar
never collide.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# A character of a JSON string as itself. The class leaves out the surrogates: xgrammar takes their
# UTF-8 form for a character, no decoder does.
_PLAIN_CHAR = r'[^"\\\x00-\x1f\uD800-\uDFFF]'
_HEX = "[0-9a-fA-F]"
# Any JSON value, in the fixed layout (the fallback for what a schema does not pin down). Character
# classes stay inline: a rule for the hex digit made xgrammar mask every token of a string against the
# whole vocabulary (230 ms a token for Qwen's, against 0.01 ms).
_ANY_JSON_RULES = "\n".join(
    [
        'json_value ::= json_object | json_array | json_string | json_number | "true" | "false" | "null"',
        'json_object ::= "{" ( json_string ": " json_value ( ", " json_string ": " json_value )* )? "}"',
        'json_array ::= "[" ( json_value ( ", " json_value )* )? "]"',
        'json_string ::= "\\"" json_char* "\\""',
        rf'json_char ::= {_PLAIN_CHAR} | "\\" ["\\/bfnrt] | "\\u" {_HEX} {_HEX} {_HEX} {_HEX}',
        'json_integer ::= "-"? ( "0" | [1-9] [0-9]* )',
        'json_number ::= json_integer ( "." [0-9]+ )? ( [eE] [-+]? [0-9]+ )?',
        "",
    ]
)
ANY_JSON = "json_value"
_TYPE_RULES = {
    "string": "json_string",
    "integer": "json_integer",
    "number": "json_number",
    "boolean": '"true" | "false"',
    "null": '"null"',
    "object": "json_object",
    "array": "json_array",
}
# Keywords this module follows; a schema with any other keyword that changes the shape falls back.
_UNFOLLOWED = ("$ref", "allOf", "not", "if", "then", "else", "patternProperties", "dependentSchemas")


# What an EBNF string literal escapes: quotes, backslashes and control characters.
_LITERAL_ESCAPES = {
    **{code: f"\\x{code:02x}" for code in range(0x20)},
    ord("\n"): "\\n",
    ord("\r"): "\\r",
    ord("\t"): "\\t",
    ord('"'): '\\"',
    ord("\\"): "\\\\",
}


def literal(text: str) -> str:
    """`text` as an EBNF string literal."""
    return '"' + text.translate(_LITERAL_ESCAPES) + '"'


def json_literal(value: Any) -> str:
    """A JSON value (enum, const) as the literal text json.dumps writes for it."""
    return literal(json.dumps(value, ensure_ascii=False))


@dataclass
class JsonGrammar:
    """Collects the rules of one grammar. `value(schema)` returns an EBNF expression; `rules()` every
    rule it needed, the shared JSON rules included once. A rule body written twice (the same schema in
    two tools) is one rule."""

    prefix: str
    _rules: dict[str, str] = field(default_factory=dict)  # body -> name

    def rule(self, body: str) -> str:
        """The name of a rule with this body, defined once."""
        name = self._rules.get(body)
        if name is None:
            name = f"{self.prefix}_{len(self._rules) + 1}"
            self._rules[body] = name
        return name

    def rules(self) -> str:
        return "\n".join(f"{name} ::= {body}" for body, name in self._rules.items()) + "\n" + _ANY_JSON_RULES

    def value(self, schema: Any) -> str:
        if schema is True or not isinstance(schema, Mapping) or not schema:
            return ANY_JSON
        if "const" in schema:
            return json_literal(schema["const"])
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return "( " + " | ".join(json_literal(v) for v in schema["enum"]) + " )"
        for keyword in ("anyOf", "oneOf"):
            options = schema.get(keyword)
            if isinstance(options, list) and options:
                # The branch's own keywords apply with the outer ones (a common "type" beside anyOf).
                outer = {k: v for k, v in schema.items() if k != keyword}
                return (
                    "( "
                    + " | ".join(self.value({**outer, **o}) for o in options if isinstance(o, Mapping))
                    + " )"
                )
        if any(keyword in schema for keyword in _UNFOLLOWED):
            return self._any_of_types(schema)
        types = schema.get("type")
        if types is None:
            types = "object" if "properties" in schema else ("array" if "items" in schema else None)
        if types is None:
            return ANY_JSON
        if isinstance(types, list):
            return "( " + " | ".join(self._typed(t, schema) for t in types) + " )"
        return self._typed(types, schema)

    def _any_of_types(self, schema: Mapping[str, Any]) -> str:
        types = schema.get("type")
        if isinstance(types, str) and types in _TYPE_RULES:
            return f"( {_TYPE_RULES[types]} )"
        return ANY_JSON

    def _typed(self, kind: Any, schema: Mapping[str, Any]) -> str:
        if kind == "object":
            return self._object(schema)
        if kind == "array":
            return self._array(schema)
        if kind == "string":
            return self._string(schema)
        if kind in _TYPE_RULES:
            return f"( {_TYPE_RULES[kind]} )"
        return ANY_JSON

    def _string(self, schema: Mapping[str, Any]) -> str:
        low, high = _bounds(schema, "minLength", "maxLength")
        if low == 0 and high is None:
            return "json_string"
        # Counted characters are plain ones, without escapes: xgrammar masks a bounded repetition of a
        # rule with alternatives token by token against the whole vocabulary (150 ms a token for Qwen's),
        # one of a character class from its precomputed cache.
        return f'( "\\"" {_PLAIN_CHAR}{{{low},{"" if high is None else high}}} "\\"" )'

    def _array(self, schema: Mapping[str, Any]) -> str:
        item = self.value(schema.get("items", True))
        low, high = _bounds(schema, "minItems", "maxItems")
        if high == 0:
            return '"[]"'
        rest_high = "" if high is None else str(high - 1)
        items = f'{item} ( ", " {item} ){{{max(low - 1, 0)},{rest_high}}}'
        return self.rule(f'"[" {items} "]"' if low > 0 else f'"[" ( {items} )? "]"')

    def _object(self, schema: Mapping[str, Any]) -> str:
        properties = schema.get("properties")
        if not isinstance(properties, Mapping) or not properties:
            return "json_object"
        required = set(schema.get("required") or ())
        members = [
            (self.rule(json_literal(name) + ' ": " ' + self.value(sub)), name in required)
            for name, sub in properties.items()
        ]
        return self.rule('"{" ' + self._members(members) + ' "}"')

    def _members(self, members: list[tuple[str, bool]]) -> str:
        """The properties in order, the required ones present, ", " between them. Two rules per position,
        from the last: what may follow once a property was written (each with its comma), and what may
        come when none was yet (the first one written has no comma)."""
        after, first = "", '""'
        for member, needed in reversed(members):
            starting_here = f"{member} {after}".strip()
            first = self.rule(starting_here if needed else f"{starting_here} | {first}")
            with_comma = f'", " {member}'
            after = self.rule(f"{with_comma if needed else f'( {with_comma} )?'} {after}".strip())
        return first


def _bounds(schema: Mapping[str, Any], low_key: str, high_key: str) -> tuple[int, int | None]:
    low, high = schema.get(low_key, 0), schema.get(high_key)
    low = low if isinstance(low, int) and not isinstance(low, bool) and low > 0 else 0
    if not isinstance(high, int) or isinstance(high, bool) or high < low:
        high = None
    return low, high
