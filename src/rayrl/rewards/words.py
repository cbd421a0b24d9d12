"""Scorer of one-word answers (the synthetic `colors` task: "What colour is the image?"
-> "red").

The answer is the last word of the response (letters only, any case). Reward 1.0 when
it is the ground truth, 0.1 when the response does end in a word that is wrong (so a
tiny policy first learns to answer with a word), 0.0 when it has no word at all.
"""

from __future__ import annotations

import re
from typing import Any

CORRECT = 1.0
WELL_FORMED = 0.1
_WORD = re.compile(r"[A-Za-z]+")


def compute_score(
    solution_str: str, ground_truth: Any, extra_info: dict[str, Any] | None = None
) -> dict[str, float]:
    """Score one response; returns {"score": ..., "acc": 1.0 or 0.0}."""
    words = _WORD.findall(solution_str)
    if not words:
        return {"score": 0.0, "acc": 0.0}
    correct = words[-1].lower() == str(ground_truth).strip().lower()
    return {"score": CORRECT if correct else WELL_FORMED, "acc": float(correct)}
