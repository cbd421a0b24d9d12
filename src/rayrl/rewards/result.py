"""RewardResult: one scored sample, and the rule that turns a reward function's return into one.

Every reward source (the process pool, the HTTP client, the reward model) answers with
`RewardResult`s, so the reward worker handles them all alike. A reward function may
return a number or a dict with a numeric "score" and extra per-sample metrics (verl's
contract); anything else is a failed call: score 0.0 and an error saying why.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RewardResult:
    """The reward of one sample.

    Attributes:
        score: the reward; 0.0 when the call failed.
        extra: per-sample metrics the function returned besides "score" (e.g. "acc").
        error: None on success; otherwise what went wrong, in words.
        elapsed_s: wall time spent scoring this sample (for batched sources, the batch).
    """

    score: float
    extra: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        """True when the sample was scored without error."""
        return self.error is None


FLOAT32_MAX = 3.4028234663852886e38


def failed(error: str, elapsed_s: float = 0.0) -> RewardResult:
    """A failed call: score 0.0 with `error`."""
    return RewardResult(score=0.0, error=error, elapsed_s=elapsed_s)


def to_result(value: Any, elapsed_s: float = 0.0) -> RewardResult:
    """Normalise a reward function's return value (a number or a dict with "score").

    Booleans, numpy scalars and one-element tensors count as numbers. A non-numeric or
    non-finite score yields a failed result that names the offending value.
    """
    extra: dict[str, Any] = {}
    score = value
    if isinstance(value, dict):
        if "score" not in value:
            keys = sorted(map(str, value))
            return failed(
                f"reward function returned a dict without a 'score' key: {keys}", elapsed_s
            )
        score = value["score"]
        extra = {str(k): v for k, v in value.items() if k != "score"}
    number = _as_float(score)
    if number is None:
        return failed(
            f"reward function must return a number or a dict with a numeric 'score'; "
            f"got {type(score).__name__}: {_short(score)}",
            elapsed_s,
        )
    if not math.isfinite(number):
        return failed(f"reward function returned a non-finite score ({number})", elapsed_s)
    if abs(number) > FLOAT32_MAX:  # scores travel as float32: it would become inf
        return failed(f"reward function returned a score beyond float32 ({number:g})", elapsed_s)
    return RewardResult(score=number, extra=extra, elapsed_s=elapsed_s)


def _as_float(value: Any) -> float | None:
    """float(value) for real numbers, numpy scalars (bool too), one-element tensors; else None."""
    if isinstance(value, str | bytes):
        return None
    if not (isinstance(value, numbers.Real) or hasattr(type(value), "__float__")):
        return None
    try:
        return float(value)
    except Exception:  # e.g. a tensor of several elements
        return None


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
