"""Rewards: rule-based scorers, user reward files, a timeout-safe process pool, HTTP and model rewards.

- `registry`: built-in scorers keyed by data_source (gsm8k, math, countdown, arithmetic)
  and a default `compute_score(data_source, solution_str, ground_truth, extra_info)`;
- `load_function`: a user file's `compute_score` (verl's signature), checked;
- `RewardPool`: runs a reward function in spawned processes with a per-call timeout;
- `REWARD_MANAGERS` / `make_scorer`: verl's reward managers (naive, prime, dapo, batch):
  how the function is called;
- `HTTPReward`: a client for a remote reward service;
- `ModelReward`: a sequence-classification reward model (imported lazily: torch);
- `make_items` / `summarize`: items from dataset rows, metrics from results.

Every source answers with `RewardResult`s (score, extra metrics, error, elapsed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rayrl.rewards.http import HTTPReward, RewardServiceError
from rayrl.rewards.items import make_items, summarize
from rayrl.rewards.loader import (
    FunctionSpec,
    RewardFunctionError,
    check_signature,
    load_function,
    resolve_function,
    spec_from_config,
)
from rayrl.rewards.managers import REWARD_MANAGERS, make_scorer
from rayrl.rewards.pool import RewardPool, RewardPoolError
from rayrl.rewards.registry import (
    UnknownDataSourceError,
    compute_score,
    get_scorer,
    known_sources,
    register_scorer,
)
from rayrl.rewards.result import RewardResult, to_result

if TYPE_CHECKING:
    from rayrl.rewards.model import ModelReward

__all__ = [
    "FunctionSpec",
    "HTTPReward",
    "REWARD_MANAGERS",
    "ModelReward",
    "RewardFunctionError",
    "RewardPool",
    "RewardPoolError",
    "RewardResult",
    "RewardServiceError",
    "UnknownDataSourceError",
    "check_signature",
    "compute_score",
    "get_scorer",
    "known_sources",
    "load_function",
    "make_items",
    "make_scorer",
    "register_scorer",
    "resolve_function",
    "spec_from_config",
    "summarize",
    "to_result",
]


def __getattr__(name: str) -> type[ModelReward]:
    if name == "ModelReward":  # keep `import rayrl.rewards` free of torch
        from rayrl.rewards.model import ModelReward

        return ModelReward
    raise AttributeError(f"module 'rayrl.rewards' has no attribute {name!r}")
