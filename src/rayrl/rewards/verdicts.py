"""Verdict parsers: a judge model's answer, in words, turned into a score.

A parser is built from the judge's config (`reward.judge.parser`, with `labels` and
`score_range`) and called on each verdict. It returns the score, or raises
`VerdictError` saying what it looked for and what it found: the built-in judge counts
that sample as a reward error (`reward.max_error_rate`), never as a silent 0.

- `number`: the last number in the verdict ("Score: 7" reads 7, but "7/10" reads 10:
  a template should ask for the score alone, last); with `score_range` [low, high] a
  number outside it fails.
- `label`: the last of the labels' words found in the verdict (whole words, case
  ignored), scored by the map (`{"correct": 1, "incorrect": 0}`).

`VERDICT_PARSERS` is the registry (`reward.judge.parser`); `make_parser` builds one.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from rayrl.registry import Registry
from rayrl.rewards._numbers import last_number, parse_number

__all__ = ["VERDICT_PARSERS", "VerdictError", "VerdictParser", "make_parser"]

VerdictParser = Callable[[str], float]

VERDICT_PARSERS: Registry[Callable[..., VerdictParser]] = Registry(
    "verdict parser", config_key="reward.judge.parser"
)


class VerdictError(ValueError):
    """A verdict the parser cannot read (the sample is a reward error)."""


def make_parser(
    name: str, labels: dict[str, Any] | None = None, score_range: Any = None
) -> VerdictParser:
    """The parser `reward.judge.parser` names, with its settings checked now (a bad map
    or range is a config mistake, raised as ValueError naming the key)."""
    return VERDICT_PARSERS.get(name)(labels=dict(labels or {}), score_range=score_range)


def _short(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


@VERDICT_PARSERS.register("number")
def number_parser(labels: dict[str, Any], score_range: Any) -> VerdictParser:
    """The last number in the verdict, within `score_range` when set."""
    low, high = _range(score_range)

    def parse(verdict: str) -> float:
        found = last_number(verdict)
        value = parse_number(found) if found is not None else None
        if value is None:
            raise VerdictError(f"no number in the judge's verdict {_short(verdict)}")
        score = float(value)
        if not low <= score <= high:
            raise VerdictError(
                f"the judge's score {score:g} is outside reward.judge.score_range "
                f"[{low:g}, {high:g}] (verdict {_short(verdict)})"
            )
        return score

    return parse


def _range(score_range: Any) -> tuple[float, float]:
    if score_range is None:
        return -math.inf, math.inf
    try:
        low, high = (float(v) for v in score_range)
    except (TypeError, ValueError):
        raise ValueError(
            f"reward.judge.score_range={score_range!r} must be [low, high] (two numbers) or null"
        ) from None
    if not low <= high:
        raise ValueError(f"reward.judge.score_range=[{low:g}, {high:g}] needs low <= high")
    return low, high


@VERDICT_PARSERS.register("label")
def label_parser(labels: dict[str, Any], score_range: Any) -> VerdictParser:
    """The last label word in the verdict (whole words, case ignored), scored by `labels`."""
    if not labels:
        raise ValueError(
            "reward.judge.parser=label needs reward.judge.labels, a map of the verdict's "
            'words to scores, e.g. {"correct": 1, "incorrect": 0}'
        )
    scores = {}
    for word, score in labels.items():
        value = score if isinstance(score, int | float) and not isinstance(score, bool) else None
        if value is None or not math.isfinite(value):
            raise ValueError(f"reward.judge.labels[{word!r}]={score!r} must be a finite number")
        scores[str(word).lower()] = float(value)
    # longest first, so that "incorrect" is not read as "correct"
    words = sorted(scores, key=len, reverse=True)
    pattern = re.compile(r"\b(" + "|".join(re.escape(w) for w in words) + r")\b", re.IGNORECASE)

    def parse(verdict: str) -> float:
        found = pattern.findall(verdict)
        if not found:
            raise VerdictError(
                f"none of the labels {sorted(scores)} in the judge's verdict {_short(verdict)}"
            )
        return scores[found[-1].lower()]

    return parse
