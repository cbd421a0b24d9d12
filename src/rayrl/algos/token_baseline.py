"""The optimal token baseline (OTB): a per-timestep baseline over each prompt's group.

Group baselines such as GRPO's subtract one number from a whole response. The optimal
token baseline subtracts, at each position ``t``, the return that minimises the
gradient's variance under a path-variance proxy::

    A_{i,t} = G_{i,t} - B_t       B_t = sum_j G_{j,t} W_{j,t} / (sum_j W_{j,t} + eps)

over the responses ``j`` to the same prompt (real tokens only), where ``G`` is the
undiscounted reward-to-go and ``W_{j,t} = sum_{k <= t} w_{j,k}`` accumulates each
token's squared score-function norm ``w = 1 - 2 pi(y_t) + sum_v pi(v)^2`` (the
sampled token's probability under the policy that generated the batch, and the sum of
squared probabilities over the vocabulary at that position). With rollout importance
weights ``rho``, ``w`` is scaled by ``rho^2``.

This is verl's ``optimal_token_baseline`` estimator (same inputs, same result). A group
of one response has no baseline (its advantage is its return). With ``handle_zero_tail``
the positions of a group's unique longest response past the second-longest one's length
get no baseline either: only that response has data there, so its baseline would be its
own return and its advantage zero.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rayrl.algos.advantages import ADV_ESTIMATORS, token_rewards
from rayrl.algos.groups import group_ids

__all__ = ["optimal_token_baseline_advantages", "path_variance_weights"]


def path_variance_weights(
    old_log_probs: Tensor,
    sum_pi_squared: Tensor,
    response_mask: Tensor,
    rollout_is_weights: Tensor | None = None,
) -> Tensor:
    """``W_t``: the cumulative sum over real tokens of ``(1 - 2 pi_t + sum pi^2) * rho^2``."""
    mask = response_mask.bool()
    w = 1.0 - 2.0 * torch.exp(old_log_probs) + sum_pi_squared
    if rollout_is_weights is not None:
        w = w * rollout_is_weights**2
    return torch.where(mask, w, torch.zeros_like(w)).cumsum(dim=-1)


def _zero_tail(lengths: Tensor, ids: Tensor, num_groups: int) -> Tensor:
    """``[batch]``: the column from which each row gets no baseline. For the unique longest
    row of a group of several, the length of the group's second-longest row (lengths
    count real tokens, as in verl); for every other row, a column past any tensor."""
    lowest = torch.full((num_groups,), -1, dtype=lengths.dtype, device=lengths.device)
    longest = lowest.scatter_reduce(0, ids, lengths, reduce="amax")
    is_longest = lengths == longest[ids]
    ties = torch.zeros_like(longest).index_add(0, ids, is_longest.to(lengths.dtype))
    shorter = torch.where(is_longest, torch.full_like(lengths, -1), lengths)
    second = lowest.scatter_reduce(0, ids, shorter, reduce="amax")
    unique = is_longest & (ties[ids] == 1) & (second[ids] >= 0)
    return torch.where(
        unique, second[ids], torch.full_like(lengths, torch.iinfo(lengths.dtype).max)
    )


@ADV_ESTIMATORS.register("optimal_token_baseline", needs_critic=False)
def optimal_token_baseline_advantages(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Any,
    old_log_probs: Tensor,
    sum_pi_squared: Tensor,
    rollout_is_weights: Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
) -> tuple[Tensor, Tensor]:
    """Advantages ``G - B`` with the optimal per-position group baseline; returns ``G``
    (both zero on padding).

    Args:
        token_level_rewards: ``[batch, len]`` token rewards, or ``[batch]`` scores.
        response_mask: 1 for real tokens.
        index: one prompt uid per response.
        old_log_probs: log-probs of the sampled tokens under the policy that generated
            the batch (``[batch, len]``).
        sum_pi_squared: ``[batch, len]`` sum over the vocabulary of squared
            probabilities at each position, from the same forward pass.
        rollout_is_weights: optional ``[batch, len]`` truncated importance weights.
        handle_zero_tail: no baseline on a unique longest response's tail (see the
            module docstring).
        epsilon: added to the baseline's denominator.
    """
    with torch.no_grad():
        mask = response_mask.bool()
        rewards = token_rewards(token_level_rewards, response_mask)
        returns = rewards.flip(-1).cumsum(-1).flip(-1)
        returns = torch.where(mask, returns, torch.zeros_like(returns))
        weights = path_variance_weights(
            old_log_probs, sum_pi_squared, response_mask, rollout_is_weights
        ).to(returns.dtype)
        ids, num_groups = group_ids(index, device=returns.device)
        zeros = torch.zeros((num_groups, returns.shape[-1]), dtype=returns.dtype, device=ids.device)
        kept = torch.where(mask, weights, torch.zeros_like(weights))
        numerator = zeros.index_add(0, ids, returns * kept)
        denominator = zeros.index_add(0, ids, kept) + epsilon
        baselines = (numerator / denominator)[ids]
        size = torch.zeros(num_groups, dtype=torch.long, device=ids.device)
        size = size.index_add(0, ids, torch.ones_like(ids))[ids]
        baselines = torch.where((size > 1).unsqueeze(-1), baselines, torch.zeros_like(baselines))
        if handle_zero_tail:
            lengths = mask.long().sum(dim=-1)
            start = _zero_tail(lengths, ids, num_groups)
            columns = torch.arange(mask.shape[-1], device=mask.device)
            tail = columns.unsqueeze(0) >= start.unsqueeze(-1)
            baselines = torch.where(tail, torch.zeros_like(baselines), baselines)
        advantages = torch.where(mask, returns - baselines, torch.zeros_like(returns))
    return advantages, returns
