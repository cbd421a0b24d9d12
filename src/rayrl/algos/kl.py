"""KL divergence to a reference policy: estimators, reward penalty, loss term, controllers.

Per-token estimators of ``KL(pi || pi_ref)`` from the log-probs of sampled tokens
(Schulman, "Approximating KL divergence"), with ``d = log_prob - ref_log_prob``:

=========  =====================================  ==========================================
``k1``     ``d``                                  unbiased, high variance, can be negative
``abs``    ``|d|``
``k2``     ``d^2 / 2``                            its gradient is the KL's true gradient
``k3``     ``exp(-d) + d - 1``                    unbiased, low variance, >= 0
=========  =====================================  ==========================================

``k3`` clamps ``-d`` to +-20 before ``exp`` and the result to +-10, so a large gap
cannot overflow into inf/NaN (the cause of the NaN losses in verl#751). A ``+`` suffix
(``k1+``, ``k3+``, ...) is the straight-through variant: the value of the named
estimator with the gradient of ``k2`` (an unbiased gradient of the KL). verl's names
``kl``, ``mse``, ``low_var_kl`` are aliases.

The KL enters training either as a reward penalty (:func:`apply_kl_penalty`, with a
coefficient from a :data:`KL_CONTROLLERS` controller) or as a loss term
(:func:`kl_loss`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from rayrl.algos.advantages import token_rewards
from rayrl.algos.aggregation import LossAggregation
from rayrl.algos.masked import masked_mean
from rayrl.registry import Registry

__all__ = [
    "KL_CONTROLLERS",
    "KL_ESTIMATORS",
    "AdaptiveKLController",
    "FixedKLController",
    "apply_kl_penalty",
    "kl_divergence",
    "kl_loss",
    "make_kl_controller",
]

KLFn = Callable[[Tensor, Tensor], Tensor]
KL_ESTIMATORS: Registry[KLFn] = Registry(
    "KL estimator", config_key="algorithm.kl_penalty (or actor_rollout_ref.actor.kl_loss_type)"
)
EXP_CLAMP = 20.0
K3_CLAMP = 10.0


def _k1(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    return log_prob - ref_log_prob


def _abs(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    return (log_prob - ref_log_prob).abs()


def _k2(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    return 0.5 * (log_prob - ref_log_prob) ** 2


def _k3(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    neg = (ref_log_prob - log_prob).clamp(-EXP_CLAMP, EXP_CLAMP)
    return (torch.exp(neg) - neg - 1.0).clamp(-K3_CLAMP, K3_CLAMP)


def _straight_through(estimator: KLFn) -> KLFn:
    """Value of ``estimator``, gradient of ``k2``."""

    def kl(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
        grad_carrier = _k2(log_prob, ref_log_prob)
        value = estimator(log_prob, ref_log_prob)
        return grad_carrier - grad_carrier.detach() + value.detach()

    kl.__doc__ = f"Straight-through KL: value of {estimator.__name__}, gradient of k2."
    return kl


for _name, _fn, _aliases in (
    ("k1", _k1, ("kl",)),
    ("abs", _abs, ()),
    ("k2", _k2, ("mse",)),
    ("k3", _k3, ("low_var_kl",)),
):
    KL_ESTIMATORS.add(_name, _fn, aliases=_aliases)
    KL_ESTIMATORS.add(_name + "+", _straight_through(_fn), aliases=tuple(a + "+" for a in _aliases))


def kl_divergence(
    log_prob: Tensor,
    ref_log_prob: Tensor,
    estimator: str = "k3",
    response_mask: Tensor | None = None,
) -> Tensor:
    """Per-token KL estimate ``[batch, response_len]`` by the estimator named.

    With ``response_mask`` padded positions are 0 (and carry no gradient, even if the
    inputs hold NaN there).
    """
    fn = KL_ESTIMATORS.get(estimator)
    if response_mask is None:
        return fn(log_prob, ref_log_prob)
    mask = response_mask.bool()
    log_prob = torch.where(mask, log_prob, torch.zeros_like(log_prob))
    ref_log_prob = torch.where(mask, ref_log_prob, torch.zeros_like(ref_log_prob))
    kl = fn(log_prob, ref_log_prob)
    return torch.where(mask, kl, torch.zeros_like(kl))


def apply_kl_penalty(
    token_level_scores: Tensor,
    old_log_prob: Tensor,
    ref_log_prob: Tensor,
    response_mask: Tensor,
    kl_coef: float,
    estimator: str = "k1",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Rewards minus ``kl_coef`` times the per-token KL, for a KL penalty in the reward.

    Args:
        token_level_scores: ``[batch, response_len]`` rewards (or ``[batch]`` scores,
            placed on each response's last real token).
        old_log_prob: the policy's log-probs of the sampled tokens.
        ref_log_prob: the reference policy's log-probs of the same tokens.
        kl_coef: the coefficient, usually ``controller.value``.

    Returns:
        ``(token_level_rewards, metrics)``. ``metrics["reward_kl_penalty"]`` is the batch
        mean of each response's mean token KL: feed it to ``controller.update(kl,
        n_steps=batch_size)``. ``metrics["reward_kl_penalty_coeff"]`` is ``kl_coef``.
    """
    scores = token_rewards(token_level_scores, response_mask)
    with torch.no_grad():
        kl = kl_divergence(old_log_prob, ref_log_prob, estimator, response_mask)
    rewards = scores - kl_coef * kl.to(scores.dtype)
    per_seq = masked_mean(kl, response_mask, dim=-1)
    metrics = {
        "reward_kl_penalty": per_seq.mean(),
        "reward_kl_penalty_coeff": torch.tensor(float(kl_coef)),
    }
    return rewards, metrics


def kl_loss(
    log_prob: Tensor,
    ref_log_prob: Tensor,
    response_mask: Tensor,
    *,
    estimator: str = "k3",
    agg: LossAggregation | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL to the reference as a loss term (GRPO style): aggregated per-token KL.

    Multiply by the coefficient (``actor_rollout_ref.actor.kl_loss_coef``) and add to the
    policy loss. The aggregation follows :mod:`rayrl.algos.aggregation`, so the term is
    split-invariant like the policy loss. Metric ``kl_loss`` is the token mean here.
    """
    kl = kl_divergence(log_prob, ref_log_prob, estimator, response_mask)
    loss = (agg or LossAggregation())(kl, response_mask)
    return loss, {"kl_loss": masked_mean(kl, response_mask).detach()}


KL_CONTROLLERS: Registry[Callable[..., FixedKLController | AdaptiveKLController]] = Registry(
    "KL controller", config_key="algorithm.kl_ctrl.type"
)


@KL_CONTROLLERS.register("fixed")
class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient stays fixed."""

    def state_dict(self) -> dict[str, float]:
        """Checkpointable state."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore from :meth:`state_dict`."""
        self.value = float(state["value"])


@KL_CONTROLLERS.register("adaptive")
class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 ("Fine-tuning LMs from human prefs").

    After each batch: ``e = clip(kl / target_kl - 1, -0.2, 0.2)`` and
    ``value *= 1 + e * n_steps / horizon``, steering the observed KL towards the target.
    """

    def __init__(self, kl_coef: float, target_kl: float, horizon: float) -> None:
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(
                f"adaptive KL controller needs target_kl > 0 and horizon > 0, got "
                f"target_kl={target_kl}, horizon={horizon} (algorithm.kl_ctrl)"
            )
        self.value = float(kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move the coefficient after observing ``current_kl`` over ``n_steps`` samples."""
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        """Checkpointable state."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore from :meth:`state_dict`."""
        self.value = float(state["value"])


def make_kl_controller(
    type: str = "fixed",
    kl_coef: float = 0.001,
    target_kl: float | None = None,
    horizon: float | None = None,
) -> FixedKLController | AdaptiveKLController:
    """Build the controller ``algorithm.kl_ctrl`` describes (``type``, ``kl_coef``, ...)."""
    cls = KL_CONTROLLERS.get(type)
    if cls is AdaptiveKLController:
        if target_kl is None or horizon is None:
            raise ValueError(
                "adaptive KL controller needs algorithm.kl_ctrl.target_kl and "
                "algorithm.kl_ctrl.horizon"
            )
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    return cls(kl_coef)
