"""Truncated importance sampling between the rollout engine and the training engine.

The rollout engine (vLLM-like kernels, bf16, CUDA graphs) and the training engine
compute slightly different log-probabilities for the same tokens, so samples are not
exactly on-policy for the trained model. Truncated importance sampling (TIS, Yao et al.
2025, "Your efficient RL framework secretly brings you off-policy RL training")
reweights each token's policy-gradient term by

    w = min(pi_old(y) / pi_rollout(y), cap)

where ``pi_old`` is the training engine's log-prob before the update (``old_log_prob``)
and ``pi_rollout`` the rollout engine's. The weights are constants (no gradient) and are
passed to any policy loss as ``is_weights``. ``level="sequence"`` uses one weight per
response, the product of its token ratios, truncated the same way.

`is_batch_norm_factor` is verl's ``rollout_is_batch_normalize``: the mean of a whole
training batch's truncated weights (over its tokens, or over its responses at the
sequence level), by which every weight is divided so that they average 1.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rayrl.algos.masked import masked_mean

__all__ = ["IS_LEVELS", "is_batch_norm_factor", "truncated_is_weights"]

IS_LEVELS = ("token", "sequence")


def truncated_is_weights(
    old_log_prob: Tensor,
    rollout_log_prob: Tensor,
    response_mask: Tensor,
    cap: float = 2.0,
    level: str = "token",
    log_ratio_clamp: float = 20.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Capped importance weights ``[batch, response_len]`` (detached) and their metrics.

    Args:
        old_log_prob: training-engine log-probs of the sampled tokens.
        rollout_log_prob: rollout-engine log-probs of the same tokens.
        response_mask: 1 for real tokens; weights are 0 on padding.
        cap: upper bound on a weight (must be positive).
        level: ``"token"`` (one weight per token) or ``"sequence"``.
        log_ratio_clamp: the log-ratio is clamped to +-this before ``exp``.

    Returns:
        ``(weights, metrics)`` with metrics ``tis_weight_mean`` (after capping),
        ``tis_clipfrac`` (fraction of tokens whose weight was capped) and
        ``rollout_logprob_abs_diff`` (mean |old - rollout| log-prob gap).
    """
    if level not in IS_LEVELS:
        raise ValueError(f"importance-sampling level {level!r} unknown; use one of {IS_LEVELS}")
    if cap <= 0:
        raise ValueError(f"importance-sampling cap must be positive, got {cap}")
    mask = response_mask.bool()
    with torch.no_grad():
        diff = torch.where(mask, old_log_prob - rollout_log_prob, 0.0)
        if level == "sequence":
            diff = diff.sum(dim=-1, keepdim=True).expand_as(diff)
        raw = torch.exp(diff.clamp(-log_ratio_clamp, log_ratio_clamp))
        weights = torch.where(mask, raw.clamp(max=cap), 0.0)
        metrics = {
            "tis_weight_mean": masked_mean(weights, mask),
            "tis_clipfrac": masked_mean((raw > cap).to(weights.dtype), mask),
            "rollout_logprob_abs_diff": masked_mean(
                torch.where(mask, old_log_prob - rollout_log_prob, 0.0).abs(), mask
            ),
        }
    return weights, metrics


def is_batch_norm_factor(weights: Tensor, response_mask: Tensor, level: str = "token") -> float:
    """The mean of a batch's truncated weights (`truncated_is_weights`), to divide them
    by: over the real tokens (``token``) or over the responses with a real token
    (``sequence``, one weight each); 1.0 when that mean is not above 1e-8."""
    if level not in IS_LEVELS:
        raise ValueError(f"importance-sampling level {level!r} unknown; use one of {IS_LEVELS}")
    mask = response_mask.to(weights.dtype)
    if level == "token":
        mean = (weights * mask).sum() / mask.sum().clamp_min(1.0)
    else:
        per_row = (weights * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)
        rows = (mask.sum(-1) > 0).to(weights.dtype)
        mean = (per_row * rows).sum() / rows.sum().clamp_min(1e-8)
    value = float(mean)
    return value if value > 1e-8 else 1.0
