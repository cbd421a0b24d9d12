"""Countdown scorer: an equation in <answer> tags must use each given number once and hit the target.

Ground truth is `{"target": int, "numbers": [int, ...]}` (TinyZero's layout). The last
`<answer>...</answer>` of the response is parsed with `ast` and evaluated exactly
(fractions) by a walker that knows only numbers, + - * /, unary minus and parentheses:
the text is never handed to `eval`, so names, calls, powers and the like are refused
before anything runs. Scores: 1.0 for a correct equation; `format_score` (0.1) when an
answer is present but wrong, malformed or uses the numbers wrongly; 0.0 without one.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterable
from fractions import Fraction
from typing import Any

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BINARY: dict[type[ast.operator], Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}
MAX_EQUATION_CHARS = 200


class EquationError(ValueError):
    """The equation uses something other than integers, + - * /, and parentheses."""


def extract_equation(solution_str: str) -> str | None:
    """The text of the last <answer>...</answer> block, stripped, or None."""
    found = _ANSWER.findall(solution_str)
    return found[-1].strip() if found else None


def parse_equation(equation: str) -> ast.expr:
    """Parse `equation` and check it holds only allowed syntax; raise EquationError if not."""
    if len(equation) > MAX_EQUATION_CHARS:
        raise EquationError(f"equation longer than {MAX_EQUATION_CHARS} characters")
    try:
        tree = ast.parse(equation, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise EquationError(f"not an expression: {exc}") from None
    for node in ast.walk(tree):
        allowed_op = isinstance(node, ast.operator | ast.unaryop) and (
            type(node) in _BINARY or isinstance(node, ast.USub)
        )
        is_int = isinstance(node, ast.Constant) and type(node.value) is int
        if not (isinstance(node, ast.BinOp | ast.UnaryOp) or allowed_op or is_int):
            raise EquationError(f"{type(node).__name__} is not allowed")
    return tree


def numbers_used(tree: ast.expr) -> list[int]:
    """The integer literals of a parsed equation (in no particular order)."""
    return [
        n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, int)
    ]


def evaluate(tree: ast.expr) -> Fraction:
    """The exact value of a checked equation; ZeroDivisionError on division by zero."""
    if isinstance(tree, ast.Constant) and isinstance(tree.value, int):
        return Fraction(tree.value)
    if isinstance(tree, ast.UnaryOp):
        return -evaluate(tree.operand)
    if isinstance(tree, ast.BinOp):
        return _BINARY[type(tree.op)](evaluate(tree.left), evaluate(tree.right))
    raise EquationError(f"{type(tree).__name__} is not allowed")


def check_equation(equation: str, numbers: Iterable[int], target: int) -> bool:
    """True when `equation` uses each of `numbers` exactly once and equals `target`.

    Raises EquationError for disallowed syntax.
    """
    tree = parse_equation(equation)
    if sorted(numbers_used(tree)) != sorted(int(n) for n in numbers):
        return False
    try:
        return evaluate(tree) == Fraction(int(target))
    except ZeroDivisionError:
        return False


def compute_score(
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    *,
    format_score: float = 0.1,
    score: float = 1.0,
) -> dict[str, float]:
    """Score one response; returns {"score": ..., "acc": 1.0 or 0.0}."""
    equation = extract_equation(solution_str)
    if equation is None:
        return {"score": 0.0, "acc": 0.0}
    if not isinstance(ground_truth, dict) or not {"numbers", "target"} <= set(ground_truth):
        raise ValueError(
            "countdown: ground_truth must be a dict {'target': int, 'numbers': [int, ...]}; "
            f"got {ground_truth!r}. Check the dataset's reward_model.ground_truth column."
        )
    try:
        correct = check_equation(equation, ground_truth["numbers"], ground_truth["target"])
    except EquationError:
        correct = False
    return {"score": float(score if correct else format_score), "acc": float(correct)}
