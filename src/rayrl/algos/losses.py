"""Policy losses (PPO clip, GSPO, REINFORCE/GPG, GMPO, CISPO, SAPO) and the clipped value loss.

Policy losses are registered in :data:`POLICY_LOSSES` under the name a config uses
(``actor_rollout_ref.actor.policy_loss.loss_mode: vanilla``) and share one signature::

    loss, metrics = fn(log_prob, old_log_prob, advantages, response_mask,
                       config=PolicyLossConfig(...), agg=LossAggregation(...),
                       is_weights=None)

- ``log_prob``: log-probs of the sampled tokens under the policy being trained
  (carries the gradient), ``[batch, response_len]``.
- ``old_log_prob``: the same before this update (no gradient).
- ``advantages``: ``[batch, response_len]``, from :mod:`rayrl.algos.advantages`.
- ``agg``: how the per-token losses become a scalar; see
  :mod:`rayrl.algos.aggregation` for how to keep the loss independent of micro-batch
  and data-parallel splits. Defaults to a local ``token-mean``.
- ``is_weights``: optional per-token constants multiplying the per-token loss, e.g.
  truncated importance weights from :mod:`rayrl.algos.correction`.

Metrics are detached scalar tensors, token means over this micro-batch, named as verl
names them: ``pg_clipfrac``, ``pg_clipfrac_lower``, ``ppo_kl``.

GMPO (``geo_mean``) and SAPO ignore ``agg``'s mode, as verl does: each is defined as a
mean over sequences, and is computed here as ``seq-mean-token-mean`` with ``agg``'s
global counts, so it stays independent of micro-batch and rank splits too.

Log-ratios are clamped to +-``log_ratio_clamp`` before ``exp`` and padded positions are
zeroed first, so neither extreme log-prob gaps nor NaN in padding produce NaN losses or
gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from rayrl.algos.aggregation import LossAggregation
from rayrl.algos.masked import masked_mean
from rayrl.registry import Registry

__all__ = [
    "POLICY_LOSSES",
    "PolicyLossConfig",
    "cispo_policy_loss",
    "geo_mean_policy_loss",
    "gspo_policy_loss",
    "ppo_policy_loss",
    "reinforce_policy_loss",
    "sapo_policy_loss",
    "value_loss",
]

Metrics = dict[str, Tensor]
PolicyLossFn = Callable[..., tuple[Tensor, Metrics]]
POLICY_LOSSES: Registry[PolicyLossFn] = Registry(
    "policy loss", config_key="actor_rollout_ref.actor.policy_loss.loss_mode"
)


@dataclass(frozen=True)
class PolicyLossConfig:
    """Hyper-parameters of the policy losses.

    Attributes:
        clip_ratio_low: the ratio is clipped below at ``1 - clip_ratio_low``.
        clip_ratio_high: ... and above at ``1 + clip_ratio_high`` (DAPO's clip-higher
            uses e.g. 0.28 with a low of 0.2). GSPO uses much smaller values (3e-4, 4e-4).
            GMPO clips the *log*-ratio to ``[-clip_ratio_low, clip_ratio_high]``.
        clip_ratio_c: dual-clip constant (Ye et al. 2020): for negative advantages the
            loss is capped at ``-A * clip_ratio_c``. ``None`` turns dual-clip off. PPO only.
        log_ratio_clamp: log-ratios are clamped to +-this before ``exp``.
        tau_pos: SAPO's gate temperature for tokens with a positive advantage.
        tau_neg: ... and for the others (verl's defaults: 1.0 and 1.05).
    """

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float | None = 3.0
    log_ratio_clamp: float = 20.0
    tau_pos: float = 1.0
    tau_neg: float = 1.05

    def __post_init__(self) -> None:
        if self.clip_ratio_low < 0 or self.clip_ratio_high < 0:
            raise ValueError(
                f"clip ratios must be >= 0, got low={self.clip_ratio_low}, "
                f"high={self.clip_ratio_high}"
            )
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            raise ValueError(
                f"dual-clip constant clip_ratio_c must be > 1 (3.0 is usual), got "
                f"{self.clip_ratio_c}; set it to None to turn dual-clip off"
            )
        if self.tau_pos <= 0 or self.tau_neg <= 0:
            raise ValueError(
                f"SAPO temperatures must be > 0, got tau_pos={self.tau_pos}, tau_neg={self.tau_neg}"
            )


def _log_ratio(log_prob: Tensor, old_log_prob: Tensor, mask: Tensor) -> Tensor:
    """``log_prob - old_log_prob`` with padding zeroed (so no NaN reaches the gradient)."""
    return torch.where(mask.bool(), log_prob - old_log_prob, torch.zeros_like(log_prob))


def _finish(
    pg_losses: Tensor, mask: Tensor, agg: LossAggregation | None, is_weights: Tensor | None
) -> Tensor:
    if is_weights is not None:
        pg_losses = pg_losses * is_weights.detach()
    return (agg or LossAggregation())(pg_losses, mask)


def _clip_metric(flags: Tensor, mask: Tensor, like: Tensor) -> Tensor:
    """Fraction of real tokens where ``flags`` is set, in ``like``'s dtype."""
    return masked_mean(flags.to(like.dtype), mask).detach()


@POLICY_LOSSES.register("ppo", aliases=("vanilla",))
def ppo_policy_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    config: PolicyLossConfig | None = None,
    agg: LossAggregation | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """PPO's clipped surrogate with separate low/high clip and optional dual-clip.

    Per token, with ``r = exp(log_prob - old_log_prob)``::

        L = max(-A r, -A clip(r, 1 - low, 1 + high))
        L = min(L, -A c)        if A < 0 and dual-clip is on

    Metrics: ``pg_clipfrac`` (tokens where the clip was active), ``pg_clipfrac_lower``
    (tokens where dual-clip was active), ``ppo_kl`` (mean ``old - new`` log-prob).
    """
    cfg = config or PolicyLossConfig()
    log_ratio = _log_ratio(log_prob, old_log_prob, response_mask)
    ratio = torch.exp(log_ratio.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp))
    advantages = torch.where(response_mask.bool(), advantages, torch.zeros_like(advantages))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)
    pg_losses = torch.maximum(unclipped, clipped)
    metrics = {
        "pg_clipfrac": _clip_metric(clipped > unclipped, response_mask, clipped),
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
    }
    if cfg.clip_ratio_c is not None:
        cap = -advantages * cfg.clip_ratio_c
        negative = advantages < 0
        metrics["pg_clipfrac_lower"] = _clip_metric(
            (pg_losses > cap) & negative, response_mask, cap
        )
        pg_losses = torch.where(negative, torch.minimum(pg_losses, cap), pg_losses)
    else:
        metrics["pg_clipfrac_lower"] = pg_losses.new_zeros(())
    return _finish(pg_losses, response_mask, agg, is_weights), metrics


@POLICY_LOSSES.register("gspo")
def gspo_policy_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    config: PolicyLossConfig | None = None,
    agg: LossAggregation | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """GSPO (Zheng et al. 2025): PPO clipping on a sequence-level importance ratio.

    ``s = exp(mean over the response of (log_prob - old_log_prob))``, applied to every
    token as ``sg[s] * pi(y_t) / sg[pi(y_t)]``: its value is ``s`` and its gradient is
    ``s * grad log pi(y_t)``. With ``seq-mean-token-mean`` aggregation this is exactly
    the paper's sequence-level objective. Advantages are meant to be constant within a
    response (GRPO-style); token-varying advantages give GSPO-token, whose per-token
    gradient ``s * A_t * grad log pi(y_t)`` is by design not the derivative of the loss
    value. Dual-clip does not apply.
    """
    cfg = config or PolicyLossConfig()
    mask = response_mask.bool()
    log_ratio = _log_ratio(log_prob, old_log_prob, response_mask)
    lengths = mask.to(log_ratio.dtype).sum(dim=-1, keepdim=True).clamp(min=1)
    seq_log_ratio = (log_ratio.sum(dim=-1, keepdim=True) / lengths).detach()
    seq_log_ratio = seq_log_ratio.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    token_log_prob = torch.where(mask, log_prob, torch.zeros_like(log_prob))
    ratio = torch.exp(token_log_prob - token_log_prob.detach() + seq_log_ratio)
    advantages = torch.where(mask, advantages, torch.zeros_like(advantages))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)
    pg_losses = torch.maximum(unclipped, clipped)
    metrics = {
        "pg_clipfrac": _clip_metric(clipped > unclipped, response_mask, clipped),
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
        "pg_clipfrac_lower": pg_losses.new_zeros(()),
    }
    return _finish(pg_losses, response_mask, agg, is_weights), metrics


@POLICY_LOSSES.register("reinforce", aliases=("gpg",))
def reinforce_policy_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    config: PolicyLossConfig | None = None,
    agg: LossAggregation | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """Plain REINFORCE: ``-A * log_prob`` per token, no ratio and no clipping.

    Exact only on-policy (one update per batch); ``old_log_prob`` serves the ``ppo_kl``
    metric. Combine with ``is_weights`` to correct a rollout/training mismatch. This is
    also GPG's loss (verl's ``gpg`` loss mode, paired with the ``gpg`` advantages).
    """
    mask = response_mask.bool()
    log_ratio = _log_ratio(log_prob, old_log_prob, response_mask)
    token_log_prob = torch.where(mask, log_prob, torch.zeros_like(log_prob))
    advantages = torch.where(mask, advantages, torch.zeros_like(advantages))
    pg_losses = -advantages * token_log_prob
    zero = pg_losses.new_zeros(())
    metrics = {
        "pg_clipfrac": zero,
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
        "pg_clipfrac_lower": zero,
    }
    return _finish(pg_losses, response_mask, agg, is_weights), metrics


def _sequence_mean(agg: LossAggregation | None) -> LossAggregation:
    """``agg``'s counts with the mean over sequences of each sequence's token mean."""
    return replace(agg or LossAggregation(), mode="seq-mean-token-mean")


@POLICY_LOSSES.register("geo_mean")
def geo_mean_policy_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    config: PolicyLossConfig | None = None,
    agg: LossAggregation | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization"): the ratio of a
    response is the geometric mean of its token ratios, each clipped first.

    Per token, the log-ratio ``l = log_prob - old_log_prob`` is clipped to
    ``[-clip_ratio_low, clip_ratio_high]`` on the side the advantage pushes it to
    (above for ``A > 0``, below for ``A < 0``): ``l' = sgn(A) min(sgn(A) l, sgn(A) clip(l))``.
    Per response, ``r = exp(mean over its tokens of l')`` and ``A`` is the mean of its
    token advantages (meant to be constant: GRPO-style); the loss is ``-A r``, averaged
    over responses (``agg``'s mode is not used). ``is_weights`` enter as their geometric
    mean over each response.

    Metrics (verl's): ``pg_clipfrac``/``pg_clipfrac_lower``: tokens with ``A > 0`` /
    ``A < 0`` whose log-ratio lies outside the clip range.
    """
    cfg = config or PolicyLossConfig()
    mask = response_mask.bool()
    log_ratio = _log_ratio(log_prob, old_log_prob, response_mask)
    advantages = torch.where(mask, advantages, torch.zeros_like(advantages))
    sign = torch.sign(advantages)
    bounded = log_ratio.clamp(-cfg.clip_ratio_low, cfg.clip_ratio_high)
    clipped = sign * torch.minimum(sign * log_ratio, sign * bounded)
    lengths = mask.to(log_ratio.dtype).sum(dim=-1, keepdim=True).clamp(min=1)
    seq_log_ratio = (clipped.sum(dim=-1, keepdim=True) / lengths).clamp(
        -cfg.log_ratio_clamp, cfg.log_ratio_clamp
    )
    seq_advantage = advantages.sum(dim=-1, keepdim=True) / lengths
    seq_losses = -seq_advantage * torch.exp(seq_log_ratio)
    if is_weights is not None:
        log_weights = torch.where(mask, torch.log(is_weights.detach() + 1e-10), 0.0)
        seq_losses = seq_losses * torch.exp(log_weights.sum(dim=-1, keepdim=True) / lengths)
    out_of_range = log_ratio != bounded
    metrics = {
        "pg_clipfrac": _clip_metric(out_of_range & (advantages > 0), response_mask, log_ratio),
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
        "pg_clipfrac_lower": _clip_metric(
            out_of_range & (advantages < 0), response_mask, log_ratio
        ),
    }
    pg_losses = seq_losses.expand_as(log_ratio)  # one value per response, on each token
    return _sequence_mean(agg)(pg_losses, response_mask), metrics


@POLICY_LOSSES.register("cispo")
def cispo_policy_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    config: PolicyLossConfig | None = None,
    agg: LossAggregation | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """CISPO (MiniMax 2025, "MiniMax-M1"): REINFORCE weighted by the clipped,
    stop-gradient importance ratio, so that no token's gradient is dropped.

    Per token: ``L = -sg[clip(r, 1 - low, 1 + high)] * A * log_prob``; the gradient is
    ``-clip(r) A grad log pi`` for every token, clipped or not (PPO zeroes the gradient
    of clipped tokens). Metric ``pg_clipfrac``: tokens whose ratio was clipped.
    """
    cfg = config or PolicyLossConfig()
    mask = response_mask.bool()
    log_ratio = _log_ratio(log_prob, old_log_prob, response_mask)
    ratio = torch.exp(log_ratio.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp))
    weight = ratio.clamp(1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high).detach()
    token_log_prob = torch.where(mask, log_prob, torch.zeros_like(log_prob))
    advantages = torch.where(mask, advantages, torch.zeros_like(advantages))
    pg_losses = -weight * advantages * token_log_prob
    metrics = {
        "pg_clipfrac": _clip_metric(ratio != weight, response_mask, ratio),
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
        "pg_clipfrac_lower": pg_losses.new_zeros(()),
    }
    return _finish(pg_losses, response_mask, agg, is_weights), metrics


@POLICY_LOSSES.register("sapo")
def sapo_policy_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    config: PolicyLossConfig | None = None,
    agg: LossAggregation | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization"): a smooth gate on the
    token ratio instead of a hard clip.

    Per token: ``L = -f(r) A`` with ``f(r) = sigmoid(tau (r - 1)) * 4 / tau``, ``tau`` being
    ``tau_pos`` where ``A > 0`` and ``tau_neg`` elsewhere. ``f'(r) = 1`` at ``r = 1``
    (the PPO gradient on-policy) and decays smoothly as ``r`` moves away. Averaged over
    responses of their token means (``agg``'s mode is not used). No clipping metrics.
    """
    cfg = config or PolicyLossConfig()
    mask = response_mask.bool()
    log_ratio = _log_ratio(log_prob, old_log_prob, response_mask)
    ratio = torch.exp(log_ratio.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp))
    advantages = torch.where(mask, advantages, torch.zeros_like(advantages))
    tau = torch.where(
        advantages > 0,
        torch.as_tensor(cfg.tau_pos, dtype=ratio.dtype, device=ratio.device),
        torch.as_tensor(cfg.tau_neg, dtype=ratio.dtype, device=ratio.device),
    )
    gates = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    pg_losses = -gates * advantages
    zero = pg_losses.new_zeros(())
    metrics = {
        "pg_clipfrac": zero,
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
        "pg_clipfrac_lower": zero,
    }
    return _finish(pg_losses, response_mask, _sequence_mean(agg), is_weights), metrics


def value_loss(
    vpreds: Tensor,
    values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    *,
    cliprange_value: float | None = 0.5,
    agg: LossAggregation | None = None,
) -> tuple[Tensor, Metrics]:
    """Clipped value loss ``0.5 * max((V - R)^2, (clip(V, V_old +- c) - R)^2)``.

    Args:
        vpreds: the critic's current predictions (carry the gradient).
        values: the critic's predictions when the batch was collected (``V_old``).
        returns: targets, e.g. the returns of :func:`rayrl.algos.advantages.gae_advantages`.
        cliprange_value: ``c``; ``None`` turns clipping off.
        agg: loss aggregation, as for the policy losses.

    Metrics: ``vf_clipfrac`` (tokens where the clipped term was larger: verl's
    definition), ``vpred_mean``.
    """
    mask = response_mask.bool()
    vpreds = torch.where(mask, vpreds, torch.zeros_like(vpreds))
    values = torch.where(mask, values, torch.zeros_like(values))
    returns = torch.where(mask, returns, torch.zeros_like(returns))
    unclipped = (vpreds - returns) ** 2
    if cliprange_value is None:
        losses, clipfrac = unclipped, unclipped.new_zeros(())
    else:
        # clamp, not values + clamp(vpreds - values): inside the range the clipped
        # prediction is exactly vpreds, so rounding never counts as clipping (verl's rule)
        clipped_pred = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
        clipped = (clipped_pred - returns) ** 2
        losses = torch.maximum(unclipped, clipped)
        clipfrac = _clip_metric(clipped > unclipped, response_mask, clipped)
    loss = 0.5 * (agg or LossAggregation())(losses, response_mask)
    metrics = {"vf_clipfrac": clipfrac, "vpred_mean": masked_mean(vpreds, mask).detach()}
    return loss, metrics
