"""GSM8K scorer: the answer follows "####" (strict) or is the last number (flexible).

GSM8K's reference solutions end with "#### 72"; a policy taught that format is scored
on the number after the last "####". `method="flexible"` instead takes the last number
anywhere in the response. Numbers compare by value ("1,000" == "1000" == "1000.00").
"""

from __future__ import annotations

import re
from typing import Any

from rayrl.rewards._numbers import NUMBER_PATTERN, last_number, parse_number

_STRICT = re.compile(r"####\s*\$?\s*(" + NUMBER_PATTERN + ")")
METHODS = ("strict", "flexible")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The answer text of a response, or None when it has none in the chosen format."""
    if method not in METHODS:
        raise ValueError(f"gsm8k: method={method!r} is not one of {METHODS}.")
    if method == "strict":
        found = _STRICT.findall(solution_str)
        return found[-1] if found else None
    return last_number(solution_str)


def compute_score(
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    *,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> dict[str, float]:
    """Score one response: `score` if its answer equals `ground_truth`.

    A response with an answer in the right format that is wrong earns `format_score`;
    one without an answer earns 0. Returns {"score": ..., "acc": 1.0 or 0.0}.
    """
    answer = extract_solution(solution_str, method)
    if answer is None:
        return {"score": 0.0, "acc": 0.0}
    expected = parse_number(ground_truth)
    correct = expected is not None and parse_number(answer) == expected
    return {"score": float(score if correct else format_score), "acc": float(correct)}
