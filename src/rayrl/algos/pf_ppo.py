"""PF-PPO (Shen and Zhang 2024, "Policy Filtration in RLHF to Fine-Tune LLM for Code
Generation"): before the update, the batch is resampled with replacement, each response
drawn with a probability that favours the responses whose rewards are more reliable.

A weight per response comes from its score by the method that ``algorithm.pf_ppo.
reweight_method`` names (registered in :data:`PF_PPO_WEIGHTS`, verl's three):

==============  ===============================================================
``pow``         ``|score| ** weight_pow``: extreme scores, good or bad, win
``max_min``     1 for the batch's highest and lowest scores, 0 for the others
``max_random``  0.4 for the highest score, 0.1 for the others
==============  ===============================================================

Every weight then gets ``1e-8`` added (so a batch of zero scores is drawn uniformly),
and :func:`pf_ppo_resample` draws as many rows as the batch holds. Pass a seeded
``torch.Generator``: the same scores and generator state draw the same rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from rayrl.registry import Registry

__all__ = ["PF_PPO_WEIGHTS", "pf_ppo_resample", "pf_ppo_weights"]

WeightFn = Callable[[Tensor, float], Tensor]
PF_PPO_WEIGHTS: Registry[WeightFn] = Registry(
    "PF-PPO reweight method", config_key="algorithm.pf_ppo.reweight_method"
)


@PF_PPO_WEIGHTS.register("pow")
def _pow(scores: Tensor, weight_pow: float) -> Tensor:
    return scores.abs().pow(weight_pow)


@PF_PPO_WEIGHTS.register("max_min")
def _max_min(scores: Tensor, weight_pow: float) -> Tensor:
    extreme = (scores == scores.max()) | (scores == scores.min())
    return extreme.to(scores.dtype)


@PF_PPO_WEIGHTS.register("max_random")
def _max_random(scores: Tensor, weight_pow: float) -> Tensor:
    best = scores == scores.max()
    return torch.where(best, 0.4, 0.1).to(scores.dtype)


def pf_ppo_weights(scores: Tensor, reweight_method: str = "pow", weight_pow: float = 2.0) -> Tensor:
    """Unnormalised sampling weights ``[batch]`` (all > 0) of the responses' ``scores``."""
    if scores.dim() != 1:
        raise ValueError(f"PF-PPO scores must be 1-D [batch], got shape {tuple(scores.shape)}")
    weights = PF_PPO_WEIGHTS.get(reweight_method)(scores, weight_pow)
    return (weights + 1e-8).clamp(min=1e-8)


def pf_ppo_resample(
    scores: Tensor,
    reweight_method: str = "pow",
    weight_pow: float = 2.0,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Row indices ``[batch]`` (int64) drawn with replacement in proportion to the weights.

    Args:
        scores: one score per response, e.g. the sum of its token-level scores.
        reweight_method: one of :data:`PF_PPO_WEIGHTS`.
        weight_pow: the exponent of ``pow``.
        generator: the random stream to draw from (on the scores' device).
    """
    with torch.no_grad():
        weights = pf_ppo_weights(scores, reweight_method, weight_pow)
        return torch.multinomial(weights, scores.shape[0], replacement=True, generator=generator)
