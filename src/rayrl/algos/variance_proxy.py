"""How noisy a step's policy gradient is, from the score-norm proxy of the optimal token
baseline (verl's ``variance_proxy/*`` metrics, reported where each token's sum of
squared probabilities is known: ``actor.calculate_sum_pi_squared``).

A response's squared score-function norm is approximated by
``W = sum_t (1 - 2 pi_t + sum_v pi_v^2)`` over its real tokens (`path_variance_weights`'
per-token terms, each scaled by ``rho_t^2`` under rollout importance weights), and the
squared norm of its gradient contribution by ``A^2 W`` with ``A`` its mean advantage.
The metrics:

- ``proxy1_signal_strength``: ``||g||^2``, the squared norm of the step's actual
  gradient (the update's ``actor/grad_norm``; 0 when unknown);
- ``proxy2_total_power``: ``E[A^2 W]`` over the responses (signal plus noise), ``W``
  clamped at 0; with importance weights ``E[rho_bar^2 A^2 W]``, ``rho_bar`` a
  response's mean weight and ``W`` without them;
- ``proxy3_pure_noise``: ``(proxy2 - proxy1) / (N - 1)``, at least 0 (0 without a
  gradient norm or with one response);
- ``expected_a_squared`` = ``E[A^2]``, ``expected_w`` = ``E[W]`` (weighted).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rayrl.algos.masked import masked_mean, masked_sum

__all__ = ["variance_proxy_metrics"]

PREFIX = "variance_proxy/"


def variance_proxy_metrics(
    old_log_probs: Tensor,
    sum_pi_squared: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    rollout_is_weights: Tensor | None = None,
    grad_norm: float | None = None,
) -> dict[str, float]:
    """The ``variance_proxy/*`` metrics (module docstring) of one step's responses.

    Args:
        old_log_probs, sum_pi_squared: ``[batch, len]`` from the log-prob pass.
        advantages: ``[batch, len]`` per token, or ``[batch]`` per response.
        response_mask: 1 for real tokens.
        rollout_is_weights: ``[batch, len]`` truncated importance weights, if any.
        grad_norm: the update's gradient norm, if known and finite.
    """
    with torch.no_grad():
        mask = response_mask.bool()
        terms = 1.0 - 2.0 * torch.exp(old_log_probs.double()) + sum_pi_squared.double()
        if advantages.dim() == 1:
            adv = advantages.double()
        else:
            adv = masked_mean(advantages.double(), mask, dim=-1)
        if rollout_is_weights is None:
            w = masked_sum(terms, mask, dim=-1)
            power = (adv**2 * w.clamp(min=0.0)).mean()
        else:
            rho = rollout_is_weights.double()
            w = masked_sum(terms * rho**2, mask, dim=-1)
            unweighted = masked_sum(terms, mask, dim=-1).clamp(min=0.0)
            power = (masked_mean(rho, mask, dim=-1) ** 2 * adv**2 * unweighted).mean()
    signal = grad_norm**2 if grad_norm is not None else None
    noise = 0.0
    if signal is not None and adv.shape[0] > 1:
        noise = max(0.0, (float(power) - signal) / (adv.shape[0] - 1))
    return {
        f"{PREFIX}proxy1_signal_strength": signal if signal is not None else 0.0,
        f"{PREFIX}proxy2_total_power": float(power),
        f"{PREFIX}proxy3_pure_noise": noise,
        f"{PREFIX}expected_a_squared": float((adv**2).mean()),
        f"{PREFIX}expected_w": float(w.mean()),
    }
