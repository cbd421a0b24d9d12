"""Scorer of the synthetic tasks ("What is 12+7?" -> "19", "Which is larger, 3 or 8?" -> "8").

The final answer is the last number in the response. Reward 1.0 when it equals the
ground truth, 0.1 when the response does end in a well-formed number that is wrong
(so a tiny policy first learns the format, then the sums), 0.0 when it has no number.
`compute_exact` (the `multiply` agent task) gives 1.0 for the right number, else 0.0.
"""

from __future__ import annotations

from typing import Any

from rayrl.rewards._numbers import last_number, parse_number

CORRECT = 1.0
WELL_FORMED = 0.1


def compute_score(
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    *,
    correct_score: float = CORRECT,
    format_score: float = WELL_FORMED,
) -> dict[str, float]:
    """Score one response; returns {"score": ..., "acc": 1.0 or 0.0}."""
    answer = last_number(solution_str)
    value = None if answer is None else parse_number(answer)
    if value is None:
        return {"score": 0.0, "acc": 0.0}
    correct = value == parse_number(ground_truth)
    return {"score": correct_score if correct else format_score, "acc": float(correct)}


def compute_exact(
    solution_str: str, ground_truth: Any, extra_info: dict[str, Any] | None = None
) -> dict[str, float]:
    """1.0 when the last number of the response is the ground truth, else 0.0."""
    return compute_score(solution_str, ground_truth, extra_info, format_score=0.0)
