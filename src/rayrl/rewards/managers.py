"""Reward managers: how a rule-based reward function is called, by verl's names
(`reward.reward_manager.name`; verl's older spelling `reward_model.reward_manager`).

- `naive` and `prime`: one sample per call, spread over `reward.num_workers` spawned
  processes, each call bounded by `reward.timeout_s` (`RewardPool`). verl's prime
  manager works that way; its naive one calls the function in the driver, one sample
  after another: the same scores, without the timeout.
- `dapo`: as naive, and a score returned as a plain number is also reported as the
  extra `acc` (as verl's DAPO manager does; dynamic sampling with
  `algorithm.filter_groups.metric=acc` reads it). DAPO's overlong penalty is
  `reward_model.overlong_buffer` (verl 0.9.1: `reward.reward_kwargs.overlong_buffer_cfg`),
  which the trainer applies to the scores.
- `batch`: one call per batch with the lists of all its samples,
  `compute_score(data_sources, solution_strs, ground_truths, extra_infos, **reward_kwargs)`,
  returning one score per sample; in one spawned process, bounded by `reward.timeout_s`
  per sample. Without a function of your own, the built-in scorers score each sample.

`make_scorer(name, spec, num_workers, timeout_s)` builds the one a config names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from rayrl.registry import Registry
from rayrl.rewards.loader import FunctionSpec
from rayrl.rewards.pool import RewardPool
from rayrl.rewards.result import RewardResult
from rayrl.rewards.source import RewardSource

REWARD_MANAGERS: Registry[Callable[[FunctionSpec, int, float], RewardSource]] = Registry(
    "reward manager", config_key="reward.reward_manager.name"
)


def make_scorer(
    manager: str, spec: FunctionSpec, num_workers: int, timeout_s: float
) -> RewardSource:
    """The reward source of manager `manager`: `score(items)`, `stats()`, `close()`."""
    return REWARD_MANAGERS.get(manager)(spec, num_workers, timeout_s)


@REWARD_MANAGERS.register("naive")
@REWARD_MANAGERS.register("prime")
def per_sample(spec: FunctionSpec, num_workers: int, timeout_s: float) -> RewardPool:
    return RewardPool(spec, num_workers=num_workers, timeout_s=timeout_s)


@REWARD_MANAGERS.register("batch")
def batched(spec: FunctionSpec, num_workers: int, timeout_s: float) -> RewardPool:
    return RewardPool(spec, num_workers=1, timeout_s=timeout_s, batched=True)


class NumberAsAcc:
    """A source whose plain-number scores are also reported as the extra `acc`."""

    def __init__(self, source: RewardSource) -> None:  # a pool, or one in front of it
        self.source = source

    def score(self, items: list[dict[str, Any]]) -> list[RewardResult]:
        return [
            replace(r, extra={"acc": r.score}) if r.ok and not r.extra else r
            for r in self.source.score(items)
        ]

    def stats(self) -> dict[str, Any]:
        return self.source.stats()

    def close(self) -> None:
        self.source.close()


@REWARD_MANAGERS.register("dapo")
def dapo(spec: FunctionSpec, num_workers: int, timeout_s: float) -> NumberAsAcc:
    return NumberAsAcc(RewardPool(spec, num_workers=num_workers, timeout_s=timeout_s))
