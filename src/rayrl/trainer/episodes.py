"""Multi-turn steps on the driver: the episodes' metrics and the token check.

`episode_metrics` sums a multi-turn rollout's per-sample columns into verl's metrics
(`multi_turn/num_turns/{mean,max,min}`, `tool/<name>/{calls,errors,timeouts,
latency_s}`, `multi_turn/<event>`) plus `multi_turn/tool_calls/mean`, the tool calls
per episode.

`token_check` compares the rows the actor is about to train on with each episode's own
record of its response (`rollout_token_ids`, `rollout_sampled`: kept turn by turn by
the rollout's driver, apart from the engine's output and everything done to the batch
since): `rollout/token_mismatch` counts the tokens of the trained `responses` or of the
response part of `input_ids` that differ from the record (a length difference counts
each missing or extra token); it must be 0. `multi_turn/tool_tokens` counts the tokens
the rollout appended (tool responses and turn separators) and
`multi_turn/loss_on_tool_tokens` those of them the loss mask (`response_mask`)
covers; it must be 0 too.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rayrl.batch import Batch
from rayrl.rollout.agent.rollout import multi_turn_metrics

RECORD = ("rollout_token_ids", "rollout_sampled")


def is_multi_turn(batch: Batch) -> bool:
    """Whether ``batch`` comes from a multi-turn rollout (it has the episode columns)."""
    return "num_turns" in batch


def episode_metrics(batch: Batch) -> dict[str, float]:
    """verl's multi-turn metrics of ``batch`` and the mean tool calls per episode."""
    metrics = multi_turn_metrics(batch)
    calls = [sum(entry["calls"] for entry in stats.values()) for stats in batch["tool_stats"]]
    metrics["multi_turn/tool_calls/mean"] = float(np.mean(calls)) if calls else 0.0
    return metrics


def token_check(batch: Batch) -> tuple[dict[str, float], str | None]:
    """The token check's metrics (module docstring) and, when a token differs, which
    sample first and where (None when all agree)."""
    width = batch["prompts"].shape[1]
    responses, ids = batch["responses"], batch["input_ids"][:, width:]
    lengths = batch["attention_mask"][:, width:].sum(-1).tolist()
    mask = batch["response_mask"]
    mismatch, appended, masked, first = 0, 0, 0, None
    for i, length in enumerate(lengths):
        tokens = np.asarray(batch["rollout_token_ids"][i], dtype=np.int64)
        sampled = np.asarray(batch["rollout_sampled"][i], dtype=np.int64)
        trained = {"responses": responses[i, :length].numpy(), "input_ids": ids[i, :length].numpy()}
        wrong = {name: _differ(row, tokens) for name, row in trained.items()}
        if any(wrong.values()) and first is None:
            name = next(name for name, count in wrong.items() if count)
            first = _where(batch, i, name, trained[name], tokens)
        mismatch += sum(wrong.values())
        tool = 1 - sampled[: min(length, len(sampled))]
        appended += int(tool.sum())
        masked += int((mask[i, : len(tool)].numpy() * tool).sum()) + int(mask[i, length:].sum())
    metrics = {
        "rollout/token_mismatch": float(mismatch),
        "multi_turn/tool_tokens": float(appended),
        "multi_turn/loss_on_tool_tokens": float(masked),
    }
    return metrics, first


def _differ(trained: np.ndarray, recorded: np.ndarray) -> int:
    """Positions where two token sequences differ, each missing or extra token counted."""
    common = min(len(trained), len(recorded))
    return int((trained[:common] != recorded[:common]).sum()) + abs(len(trained) - len(recorded))


def _where(batch: Batch, row: int, name: str, trained: np.ndarray, recorded: np.ndarray) -> str:
    """Which sample, in which column (`responses` or the response part of `input_ids`),
    and at which response position the trained tokens first differ from the record."""
    common = min(len(trained), len(recorded))
    differs = np.flatnonzero(trained[:common] != recorded[:common])
    at = int(differs[0]) if len(differs) else common
    uid: Any = batch["uid"][row] if "uid" in batch.non_tensors else row
    return (
        f"sample {uid}: {len(trained)} response tokens trained in {name}, {len(recorded)} "
        f"recorded by the rollout; first difference at response position {at}"
    )
