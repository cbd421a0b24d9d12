"""Reward items from dataset rows, and per-batch summaries of RewardResults.

An *item* is what every reward source scores: `{data_source, solution_str,
ground_truth, extra_info}` (plus "prompt" for the reward model). `make_items` builds
them from the columns of verl-layout rows, where the ground truth sits in
`reward_model["ground_truth"]`. `summarize` turns a batch of results into metrics.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

from rayrl.rewards.result import RewardResult


def make_items(
    data_sources: Sequence[str],
    solution_strs: Sequence[str],
    reward_models: Sequence[dict[str, Any]],
    extra_infos: Sequence[Any] | None = None,
    prompts: Sequence[Any] | None = None,
) -> list[dict[str, Any]]:
    """One item per response, from the dataset columns of its prompt row.

    `reward_models[i]` is the row's `reward_model` dict ({"style", "ground_truth"}).
    Raises ValueError naming the column whose length differs or the row without a
    ground truth.
    """
    n = len(solution_strs)
    columns: dict[str, Sequence[Any] | None] = {
        "data_source": data_sources,
        "reward_model": reward_models,
    }
    columns |= {"extra_info": extra_infos, "prompt": prompts}
    for name, column in columns.items():
        if column is not None and len(column) != n:
            raise ValueError(f"make_items: {len(column)} values of {name} for {n} responses.")
    items = []
    for i in range(n):
        reward_model = reward_models[i]
        if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
            raise ValueError(
                f"make_items: row {i} has reward_model={reward_model!r}; expected a dict with "
                "'ground_truth' (verl's dataset layout). Check the dataset's reward_model column."
            )
        item = {
            "data_source": data_sources[i],
            "solution_str": solution_strs[i],
            "ground_truth": reward_model["ground_truth"],
            "extra_info": None if extra_infos is None else extra_infos[i],
        }
        if prompts is not None:
            item["prompt"] = prompts[i]
        items.append(item)
    return items


def summarize(results: Sequence[RewardResult]) -> dict[str, float]:
    """Batch metrics: score mean/min/max, error count, mean elapsed time, extra means.

    A numeric extra metric ("acc") is averaged over the results that carry it, as
    "acc/mean". Keys have no prefix; the caller adds one (e.g. "reward/").
    """
    if not results:
        return {}
    scores = [r.score for r in results]
    out = {
        "score/mean": sum(scores) / len(scores),
        "score/min": min(scores),
        "score/max": max(scores),
        "errors": float(sum(not r.ok for r in results)),
        "elapsed_s/mean": sum(r.elapsed_s for r in results) / len(results),
    }
    extras: dict[str, list[float]] = {}
    for result in results:
        for key, value in result.extra.items():
            if isinstance(value, numbers.Real) and math.isfinite(float(value)):
                extras.setdefault(key, []).append(float(value))
    out |= {f"{key}/mean": sum(vals) / len(vals) for key, vals in sorted(extras.items())}
    return out
