"""Advantage estimators: GAE, GRPO (and Dr.GRPO), RLOO, REINFORCE++, REINFORCE++-baseline,
ReMax, GPG (and the optimal token baseline, in :mod:`rayrl.algos.token_baseline`).

Every estimator is registered in :data:`ADV_ESTIMATORS` under the name a config uses
(``algorithm.adv_estimator: grpo``) and returns ``(advantages, returns)``, both
``[batch, response_len]`` and zero on padded positions.

Inputs follow verl's conventions:

- ``token_level_rewards``: ``[batch, response_len]`` rewards on response tokens
  (usually only the last one is non-zero), or ``[batch]`` sequence scores.
- ``response_mask``: 1 for real response tokens. Masks may have holes (e.g. tool
  output inside a multi-turn response): time-recursive estimators (GAE, REINFORCE++)
  skip masked positions, so discounting counts only real tokens.
- ``index``: one prompt uid per response (numpy str/object array, list, or integer
  tensor) for the group-based estimators.

Sequence-level estimators score a response by summing its token rewards over *all*
positions, masked or not, so a response whose mask was cleared (DAPO's masking of
truncated responses) still counts in its group's baseline. A group holding a single
response has no baseline: as in verl, its mean is taken as 0 and its std as 1.

Use :func:`compute_advantages` to call an estimator by name with whatever inputs the
trainer has; it passes each estimator only the inputs it takes and says what is missing.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from rayrl.algos.groups import group_stats
from rayrl.algos.masked import masked_whiten
from rayrl.registry import Registry

__all__ = [
    "ADV_ESTIMATORS",
    "compute_advantages",
    "discounted_returns",
    "dr_grpo_advantages",
    "gae_advantages",
    "gpg_advantages",
    "grpo_advantages",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "remax_advantages",
    "rloo_advantages",
    "sequence_scores",
    "token_rewards",
]

AdvantageFn = Callable[..., tuple[Tensor, Tensor]]
ADV_ESTIMATORS: Registry[AdvantageFn] = Registry(
    "advantage estimator", config_key="algorithm.adv_estimator"
)


def sequence_scores(token_level_rewards: Tensor) -> Tensor:
    """One score per response ``[batch]``: the sum of its token rewards (or the scores)."""
    if token_level_rewards.dim() == 1:
        return token_level_rewards
    return token_level_rewards.sum(dim=-1)


def token_rewards(token_level_rewards: Tensor, response_mask: Tensor) -> Tensor:
    """Token rewards ``[batch, response_len]`` zeroed on padding.

    ``[batch]`` sequence scores are placed on each response's last real token (a response
    with no real token gets none).
    """
    mask = response_mask.bool()
    if token_level_rewards.dim() == 2:
        return torch.where(mask, token_level_rewards, torch.zeros_like(token_level_rewards))
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, -1).amax(dim=-1)
    placed = torch.zeros(mask.shape, dtype=token_level_rewards.dtype, device=mask.device)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    placed[rows, last[rows]] = token_level_rewards[rows]
    return placed


def broadcast_scores(scores: Tensor, response_mask: Tensor) -> Tensor:
    """``[batch]`` scores copied onto every real token of each response.

    The estimators registered with ``per_sequence=True`` end with this and depend on
    the rewards only through `sequence_scores`: their advantages can be computed from
    one score per row and broadcast where the masks are (`expand_advantages`)."""
    mask = response_mask.bool()
    return torch.where(mask, scores.unsqueeze(-1).expand(mask.shape), 0.0).to(scores.dtype)


def discounted_returns(rewards: Tensor, response_mask: Tensor, gamma: float) -> Tensor:
    """Reward-to-go ``sum_k gamma^k r_{t+k}`` over real tokens, skipping masked ones."""
    mask = response_mask.bool()
    rewards = torch.where(mask, rewards, torch.zeros_like(rewards))
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[-1])):
        running = torch.where(mask[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return torch.where(mask, returns, torch.zeros_like(returns))


@ADV_ESTIMATORS.register("gae", needs_critic=True)
def gae_advantages(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    values: Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) with a critic's ``values``.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t+1}``,
    with ``V`` after the last real token taken as 0. Returns are ``A + V`` (before
    whitening); advantages are whitened over the batch when ``whiten``.
    """
    mask = response_mask.bool()
    rewards = token_rewards(token_level_rewards, response_mask)
    values = torch.where(mask, values, torch.zeros_like(values)).to(rewards.dtype)
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    next_adv = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[-1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * next_adv
        advantages[:, t] = adv_t
        next_value = torch.where(mask[:, t], values[:, t], next_value)
        next_adv = torch.where(mask[:, t], adv_t, next_adv)
    returns = torch.where(mask, advantages + values, torch.zeros_like(advantages))
    advantages = torch.where(mask, advantages, torch.zeros_like(advantages))
    if whiten:
        advantages = masked_whiten(advantages, response_mask)
    return advantages, returns


@ADV_ESTIMATORS.register("grpo", needs_critic=False, per_sequence=True)
def grpo_advantages(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Any,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[Tensor, Tensor]:
    """GRPO (Shao et al. 2024): score minus its group's mean, divided by the group's std.

    With ``norm_adv_by_std_in_grpo=False`` the std division is dropped, which is
    Dr.GRPO's advantage (Liu et al. 2025). The std is Bessel-corrected; ``epsilon`` is
    added to it. Advantages and returns are equal.
    """
    scores = sequence_scores(token_level_rewards)
    stats = group_stats(scores, index)
    single = stats.size <= 1
    mean = torch.where(single, torch.zeros_like(stats.mean), stats.mean)
    advantages = scores - mean
    if norm_adv_by_std_in_grpo:
        std = torch.where(single, torch.ones_like(stats.std), stats.std)
        advantages = advantages / (std + epsilon)
    advantages = broadcast_scores(advantages, response_mask)
    return advantages, advantages


@ADV_ESTIMATORS.register("dr_grpo", needs_critic=False, per_sequence=True)
def dr_grpo_advantages(
    token_level_rewards: Tensor, response_mask: Tensor, index: Any
) -> tuple[Tensor, Tensor]:
    """Dr.GRPO: GRPO without the std division (pair it with ``seq-mean-token-sum-norm``)."""
    return grpo_advantages(token_level_rewards, response_mask, index, norm_adv_by_std_in_grpo=False)


@ADV_ESTIMATORS.register("rloo", needs_critic=False, per_sequence=True)
def rloo_advantages(
    token_level_rewards: Tensor, response_mask: Tensor, index: Any
) -> tuple[Tensor, Tensor]:
    """REINFORCE leave-one-out (Ahmadian et al. 2024): score minus the mean of the others.

    The baseline for a response is the mean score of the *other* responses to its
    prompt, ``(sum - s_i) / (n - 1)``; a lone response keeps its score.
    """
    scores = sequence_scores(token_level_rewards)
    stats = group_stats(scores, index)
    others = (stats.total - scores) / (stats.size - 1).clamp(min=1)
    advantages = torch.where(stats.size > 1, scores - others, scores)
    advantages = broadcast_scores(advantages, response_mask)
    return advantages, advantages


@ADV_ESTIMATORS.register("reinforce_plus_plus", needs_critic=False)
def reinforce_plus_plus_advantages(
    token_level_rewards: Tensor, response_mask: Tensor, gamma: float = 1.0
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025): discounted reward-to-go, whitened over the whole batch.

    Returns the whitened advantages and the un-whitened discounted returns.
    """
    rewards = token_rewards(token_level_rewards, response_mask)
    returns = discounted_returns(rewards, response_mask, gamma)
    return masked_whiten(returns, response_mask), returns


@ADV_ESTIMATORS.register("reinforce_plus_plus_baseline", needs_critic=False)
def reinforce_plus_plus_baseline_advantages(
    token_level_rewards: Tensor, response_mask: Tensor, index: Any
) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline: score minus its group's mean, then whitened over the batch."""
    scores = sequence_scores(token_level_rewards)
    stats = group_stats(scores, index)
    mean = torch.where(stats.size <= 1, torch.zeros_like(stats.mean), stats.mean)
    advantages = masked_whiten(broadcast_scores(scores - mean, response_mask), response_mask)
    return advantages, advantages


@ADV_ESTIMATORS.register("remax", needs_critic=False)
def remax_advantages(
    token_level_rewards: Tensor, response_mask: Tensor, reward_baselines: Tensor
) -> tuple[Tensor, Tensor]:
    """ReMax (Li et al. 2023): reward-to-go minus the reward of a greedy rollout.

    Args:
        reward_baselines: ``[batch]`` reward of the greedy response to the same prompt.
    Returns the advantages and the (undiscounted) reward-to-go.
    """
    rewards = token_rewards(token_level_rewards, response_mask)
    returns = discounted_returns(rewards, response_mask, gamma=1.0)
    baseline = broadcast_scores(reward_baselines.to(returns.dtype), response_mask)
    advantages = returns - baseline
    return advantages, returns


@ADV_ESTIMATORS.register("gpg", needs_critic=False, per_sequence=True)
def gpg_advantages(
    token_level_rewards: Tensor, response_mask: Tensor, index: Any, f_norm: float = 1.0
) -> tuple[Tensor, Tensor]:
    """GPG (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for
    Model Reasoning"): score minus its group's mean, scaled up by ``alpha``.

    ``A_i = alpha * (s_i - mean of s over i's group) / f_norm`` with
    ``alpha = B / (number of responses in the batch whose score is non-zero)`` (that
    number taken as at least 1), as verl computes the paper's batch correction
    ``B / (B - M)``: ``M`` counted as the responses scored zero. No std division; a
    group holding a single response has a mean of 0. Advantages and returns are equal.
    """
    scores = sequence_scores(token_level_rewards)
    stats = group_stats(scores, index)
    mean = torch.where(stats.size <= 1, torch.zeros_like(stats.mean), stats.mean)
    nonzero = torch.count_nonzero(scores).clamp(min=1).to(scores.dtype)
    alpha = scores.shape[0] / nonzero
    advantages = broadcast_scores(alpha * (scores - mean) / f_norm, response_mask)
    return advantages, advantages


def expand_advantages(advantages: Tensor, response_mask: Tensor) -> Tensor:
    """Per-token advantages: ``[batch]`` per-sequence ones (a ``per_sequence``
    estimator's, computed from one score per row) broadcast onto the real tokens,
    exactly as the estimator would have; ``[batch, response_len]`` ones as they are."""
    return broadcast_scores(advantages, response_mask) if advantages.dim() == 1 else advantages


def compute_advantages(name: str, **inputs: Any) -> tuple[Tensor, Tensor]:
    """Run the estimator registered as ``name`` with the inputs it takes.

    Pass everything the trainer has (``token_level_rewards``, ``response_mask``,
    ``index``, ``values``, ``reward_baselines``, ``gamma``, ``lam``, ...); inputs the
    estimator does not take are ignored, and a missing required input is an error that
    says which one. ``None`` counts as missing.
    """
    estimator = ADV_ESTIMATORS.get(name)
    params = inspect.signature(estimator).parameters
    given = {k: v for k, v in inputs.items() if k in params and v is not None}
    missing = [
        p.name
        for p in params.values()
        if p.default is inspect.Parameter.empty and p.name not in given
    ]
    if missing:
        needs = ", ".join(missing)
        hint = " (it needs a critic: configure one)" if "values" in missing else ""
        raise ValueError(f"advantage estimator {name!r} needs input(s) {needs}{hint}")
    return estimator(**given)
