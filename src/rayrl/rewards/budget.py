"""Reward sources that fail: one error budget for every reward kind, and bounds on
reward-model scores.

`ErrorBudget` wraps any reward source (a reward function through its manager, the
HTTP service, a reward model). A sample fails when its function raised, hung past
`reward.timeout_s`, or returned no finite number (NaN, None, a string); when the HTTP
service is down (after its retries) every item of that call fails. A failed sample
scores 0 with its reason, is counted (`reward/errors`) and training goes on. Once the
failed samples exceed `max_error_rate` of all samples scored so far (validation
included), `RewardErrorRateError` names the reward, both counts, the first failures'
reasons and what to do: a reward that fails persistently stops the run instead of
training on zeros. The count is an `ErrorTally`, kept where every scored sample is
seen: in a run, by the trainer (a step's rows are split over the reward workers, each
of which sees only its part); by `ErrorBudget` itself when it is used on its own. The
rate is `reward.max_error_rate` (default 0.5; 1.0 never stops);
`reward.http.max_error_rate`, when set, overrides it for the HTTP service.

`transform_score` bounds a reward model's raw output (`clip` to +-scale or
`tanh`-squash it to (-scale, scale)) so that one extreme score cannot blow up the
advantages or the KL balance.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any, Protocol

from rayrl.rewards.http import RewardServiceError
from rayrl.rewards.result import RewardResult, failed

log = logging.getLogger(__name__)

SCORE_TRANSFORMS = ("none", "clip", "tanh")
RATE_KEY = "reward.max_error_rate"
FIRST_FAILURES = 3  # failures the error quotes, the first of the run


class Source(Protocol):
    def score(self, items: list[dict[str, Any]]) -> list[RewardResult]: ...


class RewardErrorRateError(RuntimeError):
    """More samples failed to score than the error budget allows; the run stops."""


class ErrorTally:
    """The samples scored so far and those that failed, against `max_error_rate`.

    `note` counts a scoring's results (quoting the run's first failures, by their sample
    number over the run); `check` raises `RewardErrorRateError` once the failed share
    exceeds the rate. Whoever sees every scored sample keeps the tally: in a run the
    trainer, whose step rows are scored by several reward workers. `state_dict` /
    `load_state_dict` let a replayed step count its samples once.

    Args:
        max_error_rate: the largest fraction of items (over the run so far) that may
            fail before `check` raises.
        key: the config key of the rate, named in the error.
        reward: the reward in words, named in the error (e.g. the function's file and
            name, the service's URL).
        advice: what to check first, in the error's "what to do".
    """

    def __init__(
        self,
        max_error_rate: float,
        key: str = RATE_KEY,
        reward: str = "the reward",
        advice: str = "fix the reward",
    ) -> None:
        if not 0.0 <= max_error_rate <= 1.0:
            raise ValueError(f"{key}={max_error_rate} must be in [0, 1]")
        self.max_error_rate, self.key = max_error_rate, key
        self.reward, self.advice = reward, advice
        self.items = self.errors = 0
        self.first: list[str] = []  # the run's first failures, as quoted in the error

    def note(self, results: list[RewardResult], item: Callable[[int], dict[str, Any]]) -> None:
        """Count `results`; `item(i)` is result i's sample (data_source, ground_truth,
        solution_str), asked for only for the failures the error quotes."""
        for position, result in enumerate(results):
            if result.ok:
                continue
            if len(self.first) < FIRST_FAILURES:
                self.first.append(
                    f"sample {self.items + position} {_describe(item(position))}: {result.error}"
                )
            self.errors += 1
        self.items += len(results)

    def check(self) -> None:
        """Raise `RewardErrorRateError` when the failed share exceeds the rate."""
        if self.items and self.errors / self.items > self.max_error_rate:
            raise RewardErrorRateError(self.message())

    def message(self) -> str:
        quoted = "\n".join(f"    {line}" for line in self.first)
        return (
            f"{self.reward} failed on {self.errors} of {self.items} samples scored so far "
            f"({self.errors / self.items:.0%}), over {self.key}={self.max_error_rate}; "
            f"the run stops rather than train on zero rewards.\n  first failures:\n{quoted}\n"
            f"  what to do: {self.advice}; or raise {self.key} (up to 1.0: never stop) "
            "to train on, failed samples scoring 0."
        )

    def state_dict(self) -> dict[str, Any]:
        return {"items": self.items, "errors": self.errors, "first": list(self.first)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.items, self.errors = int(state["items"]), int(state["errors"])
        self.first = list(state["first"])


class ErrorBudget:
    """Score through `source`, counting failures in an `ErrorTally` (the arguments after
    `source` are its own); with `enforce`, `score` raises `RewardErrorRateError` once
    they exceed `max_error_rate` of all items. A `RewardServiceError` the source raises
    (an HTTP outage) fails every item of that call. A reward worker scores without
    enforcing: its rows are only part of a step's, and the trainer keeps the run's tally.
    """

    def __init__(
        self,
        source: Source,
        max_error_rate: float,
        key: str = RATE_KEY,
        reward: str = "the reward",
        advice: str = "fix the reward",
        enforce: bool = True,
    ) -> None:
        self.source, self.enforce = source, enforce
        self.tally = ErrorTally(max_error_rate, key, reward, advice)
        self.outages = 0

    def score(self, items: list[dict[str, Any]]) -> list[RewardResult]:
        try:
            results = self.source.score(items)
        except RewardServiceError as exc:
            self.outages += 1
            log.warning("reward outage, %d items score 0: %s", len(items), exc)
            results = [failed(f"reward service outage: {exc}") for _ in items]
        self.tally.note(results, items.__getitem__)
        if self.enforce:
            self.tally.check()
        return results

    def stats(self) -> dict[str, float]:
        stats = getattr(self.source, "stats", None)
        inner = stats() if callable(stats) else {}
        tally = self.tally
        return {**inner, "items": tally.items, "errors": tally.errors, "outages": self.outages}

    def close(self) -> None:
        close = getattr(self.source, "close", None)
        if callable(close):
            close()


def _describe(item: dict[str, Any]) -> str:
    """A failed sample in brief: its data source, ground truth and response's start."""
    response = str(item.get("solution_str", ""))
    response = response if len(response) <= 40 else response[:37] + "..."
    return (
        f"(data_source={item.get('data_source')!r}, ground_truth="
        f"{_short(item.get('ground_truth'))}, response={response!r})"
    )


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
