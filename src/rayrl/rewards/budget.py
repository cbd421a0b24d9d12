"""Reward sources that fail: an error budget, and bounds on reward-model scores.

`ErrorBudget` wraps a remote source (the HTTP service). When the source raises (the
service is down, times out after its retries, or breaks the protocol), every item of
that call scores 0 with the reason, is counted and logged, and training goes on. Once
the failed items exceed `max_error_rate` of all items scored so far, it raises
`RewardServiceError` with both numbers: an outage that persists stops the run instead
of training on zeros.

`transform_score` bounds a reward model's raw output (`clip` to +-scale or
`tanh`-squash it to (-scale, scale)) so that one extreme score cannot blow up the
advantages or the KL balance.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Protocol

from rayrl.rewards.http import RewardServiceError
from rayrl.rewards.result import RewardResult, failed

log = logging.getLogger(__name__)

SCORE_TRANSFORMS = ("none", "clip", "tanh")


class Source(Protocol):
    def score(self, items: list[dict[str, Any]]) -> list[RewardResult]: ...


class ErrorBudget:
    """Score through `source`, tolerating failures up to `max_error_rate` of all items.

    Args:
        source: a reward source whose `score` may raise `RewardServiceError`.
        max_error_rate: the largest fraction of items (over the run so far) that may
            fail before `score` raises.
        key: the config key of the rate, named in the error.
    """

    def __init__(
        self, source: Source, max_error_rate: float, key: str = "reward.http.max_error_rate"
    ) -> None:
        if not 0.0 <= max_error_rate <= 1.0:
            raise ValueError(f"{key}={max_error_rate} must be in [0, 1]")
        self.source, self.max_error_rate, self.key = source, max_error_rate, key
        self.items = self.errors = self.outages = 0

    def score(self, items: list[dict[str, Any]]) -> list[RewardResult]:
        try:
            results = self.source.score(items)
        except RewardServiceError as exc:
            self.outages += 1
            log.warning("reward outage, %d items score 0: %s", len(items), exc)
            results = [failed(f"reward service outage: {exc}") for _ in items]
        self.items += len(items)
        self.errors += sum(not r.ok for r in results)
        if self.items and self.errors / self.items > self.max_error_rate:
            raise RewardServiceError(
                f"{self.errors} of {self.items} samples scored so far failed "
                f"({self.errors / self.items:.0%}), over {self.key}={self.max_error_rate}; "
                f"last error: {_last_error(results)}. Check the reward service, or raise "
                f"{self.key} to tolerate more."
            )
        return results

    def stats(self) -> dict[str, float]:
        return {"items": self.items, "errors": self.errors, "outages": self.outages}


def _last_error(results: list[RewardResult]) -> str:
    errors = [r.error for r in results if r.error]
    return errors[-1] if errors else "(none in the last call)"


def transform_score(score: float, transform: str, scale: float) -> float:
    """A reward model's score bounded: `clip` to [-scale, scale], `tanh` to
    scale * tanh(score / scale), `none` as it is."""
    if transform == "none":
        return score
    if scale <= 0:
        raise ValueError(f"reward_model.score_scale={scale} must be positive")
    if transform == "clip":
        return max(-scale, min(scale, score))
    if transform == "tanh":
        return scale * math.tanh(score / scale)
    raise ValueError(f"reward_model.score_transform={transform!r} is not one of {SCORE_TRANSFORMS}")


class BoundedScores:
    """A reward model source whose scores go through `transform_score`; the raw score
    stays in each result's extras as `raw_score`."""

    def __init__(self, source: Source, transform: str, scale: float) -> None:
        transform_score(0.0, transform, scale)  # fail early on a bad transform or scale
        self.source, self.transform, self.scale = source, transform, scale

    def score(self, items: list[dict[str, Any]]) -> list[RewardResult]:
        results = self.source.score(items)
        if self.transform == "none":
            return results
        return [
            RewardResult(
                score=transform_score(r.score, self.transform, self.scale),
                extra={**r.extra, "raw_score": r.score},
                error=r.error,
                elapsed_s=r.elapsed_s,
            )
            for r in results
        ]
