"""The ``calculator`` tool: arithmetic on an expression, without ``eval``.

The expression is parsed with `ast` and only numbers, ``+ - * / // % **``, unary
signs, parentheses and a few functions (``abs``, ``round``, ``min``, ``max``,
``sqrt``, ``floor``, ``ceil``, ``log``, ``exp``, ``sin``, ``cos``, ``tan``) and
constants (``pi``, ``e``) are evaluated; anything else (names, attributes, calls of
other functions, strings) is refused with a message. Powers are bounded so that an
expression like ``9**9**9`` is refused instead of running for minutes.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from rayrl.envs.registry import TOOLS
from rayrl.envs.tool import Tool

__all__ = ["Calculator", "evaluate"]

MAX_EXPRESSION_CHARS = 1000
MAX_EXPONENT = 10_000
MAX_MAGNITUDE = 10**4000

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}
_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "abs": abs,
    "round": round,
    "min": min,
    "max": max,
    "sqrt": math.sqrt,
    "floor": math.floor,
    "ceil": math.ceil,
    "log": math.log,
    "exp": math.exp,
    "sin": math.sin,
    "cos": math.cos,
    "tan": math.tan,
}
_CONSTANTS = {"pi": math.pi, "e": math.e}


class CalculatorError(ValueError):
    """The expression is not arithmetic the calculator evaluates."""


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression (see the module docstring)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise CalculatorError(f"not an arithmetic expression ({err.msg})") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        return _bounded(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords:
        fn = _FUNCTIONS.get(node.func.id)
        if fn is not None:
            return _bounded(fn(*[_eval(arg) for arg in node.args]))
        raise CalculatorError(f"unknown function {node.func.id!r}; known: {', '.join(_FUNCTIONS)}")
    raise CalculatorError(f"{ast.unparse(node)!r} is not allowed; use numbers and + - * / // % **")


def _check_power(base: Any, exponent: Any) -> None:
    if abs(exponent) > MAX_EXPONENT or (
        abs(base) > 1 and abs(exponent) * math.log10(abs(base)) > 4000
    ):
        raise CalculatorError("the power is too large")


def _bounded(value: Any) -> Any:
    if isinstance(value, int) and abs(value) > MAX_MAGNITUDE:
        raise CalculatorError("the result is too large")
    return value


@TOOLS.register("calculator")
class Calculator(Tool):
    """Evaluates an arithmetic expression."""

    name = "calculator"
    description = "Evaluate an arithmetic expression, e.g. '(3 + 4) * 12 / 7'."
    parameters = {
        "type": "object",
        "properties": {
            "expression": {"type": "string", "description": "The arithmetic expression."}
        },
        "required": ["expression"],
    }

    def execute(self, arguments: dict[str, Any], state: Any) -> str:
        try:
            value = evaluate(arguments["expression"])
        except (CalculatorError, ArithmeticError, ValueError, TypeError) as err:
            return f"Error: {err}"
        if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
            value = int(value)
        return str(value)
