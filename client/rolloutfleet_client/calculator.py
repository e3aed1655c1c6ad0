"""The example rollout's tool: a calculator for + - * / on numbers, evaluated without `eval`.

The model writes the expression, so it is untrusted input: only numbers, the four operators, unary
minus and parentheses are accepted, the text is bounded, and a result's size is bounded too.
"""

from __future__ import annotations

import ast
import json
import operator
from typing import Any

CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "for example 12 * (3 + 4)"}},
            "required": ["expression"],
        },
    },
}
MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 1e15
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


class CalculatorError(ValueError):
    pass


def _value(node: ast.AST) -> float:
    value = node.value if isinstance(node, ast.Constant) else None
    if isinstance(value, int | float) and not isinstance(value, bool):
        if abs(value) > MAX_MAGNITUDE:
            raise CalculatorError("number too large")
        return value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _value(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise CalculatorError("division by zero")
        result = _OPERATORS[type(node.op)](left, right)
        if abs(result) > MAX_MAGNITUDE:
            raise CalculatorError("result too large")
        return result
    raise CalculatorError(f"unsupported expression element: {type(node).__name__}")


def evaluate(expression: str) -> str:
    """The expression's value as text (integers without a decimal point)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"not an arithmetic expression: {exc.msg}") from None
    value = _value(tree.body)
    return str(int(value)) if float(value).is_integer() else f"{value:.10g}"


def run_tool_call(call: dict[str, Any]) -> str:
    """The tool message content answering one OpenAI tool call (errors become text for the model)."""
    function = call.get("function") or {}
    if function.get("name") != "calculator":
        return f"error: unknown tool {function.get('name')!r}"
    try:
        arguments = json.loads(function.get("arguments") or "{}")
        return evaluate(str(arguments["expression"]))
    except (ValueError, KeyError, TypeError) as exc:
        return f"error: {exc}"
