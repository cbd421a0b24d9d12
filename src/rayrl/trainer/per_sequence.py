"""Advantages from one score per row, for estimators that allow it.

GRPO, Dr.GRPO, RLOO and GPG (`ADV_ESTIMATORS` entries with ``per_sequence``) give
every token of a response the same advantage: a function of the rows' scores and
groups, broadcast onto the response mask. Without a KL term in the reward, a row's
token rewards are its score on its last real token, so their sum is the score itself
(0 for an empty response). So the controller runs the estimator on the rows' scores
alone, with a one-column mask, and keeps one advantage per row; the actor's ranks
broadcast it onto the masks they hold (`rayrl.algos.expand_advantages`), the same
operation the estimator ends with, so the per-token values are bitwise the ones the
estimator computes over the whole token matrix. The controller never needs the token
columns, which can stay with the workers (`trainer.rows_on_workers`).

The batch's metrics over tokens (`critic/advantages/*`, `critic/returns/*`) come from
the per-row values weighted by each row's real tokens: equal up to rounding.
"""

from __future__ import annotations

import torch

from rayrl.algos import compute_advantages
from rayrl.batch import Batch
from rayrl.config.schema import RayRLConfig


def response_lengths(batch: Batch) -> torch.Tensor:
    """Each row's real response tokens before any masking: the generated samples'
    `response_length` column, else the response mask's sum."""
    if "response_length" in batch:
        return batch["response_length"]
    return batch["response_mask"].sum(-1)


def mask_counts(batch: Batch) -> torch.Tensor:
    """Each row's tokens in the loss now: the response mask's sum where the controller
    holds the mask (a masking step changed it there), else the generated lengths."""
    if "response_mask" in batch.tensors:
        return batch["response_mask"].sum(-1)
    return response_lengths(batch)


def per_sequence_advantages(cfg: RayRLConfig, batch: Batch) -> dict[str, float]:
    """Adds `advantages` and `returns`, one value per row (``[batch]``), to `batch`;
    returns the advantage, return and reward metrics."""
    alg = cfg.algorithm
    nonempty = response_lengths(batch) > 0
    scores = torch.where(nonempty, batch["scores"], torch.zeros_like(batch["scores"]))
    adv, returns = compute_advantages(
        alg.adv_estimator,
        token_level_rewards=scores,
        response_mask=nonempty.unsqueeze(-1),
        index=batch["uid"],
        gamma=alg.gamma,
        lam=alg.lam,
        norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo,
    )
    batch["advantages"], batch["returns"] = adv.squeeze(-1), returns.squeeze(-1)
    counts = mask_counts(batch)
    return {
        **token_spread("critic/advantages", batch["advantages"], counts),
        **token_spread("critic/returns", batch["returns"], counts),
        **token_spread("critic/rewards", scores, torch.ones_like(counts)),
    }


def token_spread(name: str, values: torch.Tensor, counts: torch.Tensor) -> dict[str, float]:
    """`<name>/mean`, `/max`, `/min` over the tokens of rows holding `values` on each of
    their `counts` tokens (rows without one left out); nothing when no token is left."""
    kept = counts > 0
    if not bool(kept.any()):
        return {}
    values, weights = values[kept].double(), counts[kept].double()
    return {
        f"{name}/mean": float((values * weights).sum() / weights.sum()),
        f"{name}/max": float(values.max()),
        f"{name}/min": float(values.min()),
    }
