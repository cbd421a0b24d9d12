"""How far the rollout's token probabilities are from the actor's, from per-row sums.

verl reports, when the rollout records its log-probs, the max, mean and standard
deviation (torch.std's, with Bessel's correction) of |p_rollout - p_actor| over the
response tokens and the Pearson correlation of the two (`training/rollout_probs_diff_*`,
`training/rollout_actor_probs_pearson_corr`), and `training/rollout_probs_diff_valid`
(1; 0 alone when no response token is real). All of them follow from a few sums per
row, which the rank that computed the actor's log-probs can send instead of the
token columns: `probs_diff_rows` on that rank, `probs_diff_metrics` on the
controller, equal to the whole-batch formulas up to rounding.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# The per-row columns `probs_diff_rows` makes (float64), over the row's real tokens
PROBS_DIFF_COLUMNS = (
    "probs_diff_max",
    "probs_diff_sum",
    "probs_diff_sq_sum",
    "probs_rollout_sum",
    "probs_actor_sum",
    "probs_rollout_sq_sum",
    "probs_actor_sq_sum",
    "probs_cross_sum",
)


def probs_diff_rows(
    rollout_log_probs: Tensor, actor_log_probs: Tensor, response_mask: Tensor
) -> dict[str, Tensor]:
    """Each row's sums of the rollout's and the actor's token probabilities (x and y)
    over its real tokens: max |x - y|, sums of |x - y|, its square, x, y, x^2, y^2, xy."""
    mask = response_mask.bool()
    x = torch.where(mask, rollout_log_probs.double().exp(), 0.0)
    y = torch.where(mask, actor_log_probs.double().exp(), 0.0)
    diff = (x - y).abs()
    values = (
        torch.where(mask, diff, -1.0).amax(-1),
        diff.sum(-1),
        (diff * diff).sum(-1),
        x.sum(-1),
        y.sum(-1),
        (x * x).sum(-1),
        (y * y).sum(-1),
        (x * y).sum(-1),
    )
    return dict(zip(PROBS_DIFF_COLUMNS, values, strict=True))


def probs_diff_metrics(rows: dict[str, Tensor], counts: Tensor) -> dict[str, float]:
    """verl's metrics from `probs_diff_rows` of every row and each row's count of real
    tokens; `training/rollout_probs_diff_valid` 0 alone when there is no real token."""
    n = float(counts.double().sum())
    if n == 0:
        return {"training/rollout_probs_diff_valid": 0.0}
    total = {key: float(rows[key].double().sum()) for key in PROBS_DIFF_COLUMNS[1:]}
    mean = total["probs_diff_sum"] / n
    # torch.std's sample variance, as verl's; one token has none
    var = max(total["probs_diff_sq_sum"] - n * mean * mean, 0.0) / (n - 1) if n > 1 else math.nan
    mx, my = total["probs_rollout_sum"] / n, total["probs_actor_sum"] / n
    cov = total["probs_cross_sum"] / n - mx * my
    vx = total["probs_rollout_sq_sum"] / n - mx * mx
    vy = total["probs_actor_sq_sum"] / n - my * my
    corr = cov / math.sqrt(vx * vy) if n > 1 and vx > 0 and vy > 0 else float("nan")
    return {
        "training/rollout_probs_diff_valid": 1.0,
        "training/rollout_probs_diff_max": float(rows["probs_diff_max"].max()),
        "training/rollout_probs_diff_mean": mean,
        "training/rollout_probs_diff_std": math.sqrt(var),
        "training/rollout_actor_probs_pearson_corr": corr,
    }


def probs_diff_from_totals(metrics: dict[str, float]) -> dict[str, float]:
    """verl's metrics from the batch's totals of `probs_diff_rows` (keys
    ``probs_diff/<column>``, the max column the largest row's, and ``probs_diff/tokens``),
    which are taken out of ``metrics``; nothing when they are not there."""
    if "probs_diff/tokens" not in metrics:
        return {}

    def total(key: str) -> torch.Tensor:
        return torch.tensor([metrics.pop(f"probs_diff/{key}")], dtype=torch.float64)

    rows = {key: total(key) for key in PROBS_DIFF_COLUMNS}
    return probs_diff_metrics(rows, total("tokens"))
