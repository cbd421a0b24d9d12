"""On-policy distillation: the student's per-token divergence to a teacher, as a loss term.

The student sampled each response; the teacher scored the same tokens
(``teacher_log_prob``). Per token, with ``d = log p_student - log p_teacher`` (the
sampled token's log-probs), the divergence is one of `rayrl.algos.kl`'s estimators of
the reverse KL ``KL(student || teacher)`` (``k1`` is ``d`` itself, ``k3`` is
``exp(-d) + d - 1``). It trains in one of two ways (verl's
``distillation_loss.use_policy_gradient``):

- **supervised** (false): the aggregated divergence is the loss and its gradient flows
  through the student's log-probs (k3's gradient is that of the reverse KL);
- **policy gradient** (true; Thinking Machines' on-policy distillation): the negative
  divergence, detached, is each token's advantage in PPO's clipped loss against the
  sampling policy's log-probs, with the term's own clip ratios.

Each token's divergence may be clamped to ``+-loss_max_clamp`` first. Metrics (shares
in the training engine's contract, `rayrl.train.loss_contract`): ``loss`` (the term as
aggregated), ``abs_loss`` (the token mean of ``|divergence|``), ``reverse_kl`` (the
token mean of ``d``), ``loss_max`` (a peak), and with the policy gradient the clipped
loss's ``pg_clipfrac``, ``pg_clipfrac_lower`` and ``ppo_kl``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from rayrl.algos.aggregation import LossAggregation
from rayrl.algos.kl import KL_ESTIMATORS, kl_divergence
from rayrl.algos.losses import PolicyLossConfig, ppo_policy_loss
from rayrl.algos.masked import masked_mean
from rayrl.registry import Registry

__all__ = ["DISTILL_LOSSES", "DistillSpec", "distillation_loss", "token_divergence"]

# verl's estimator names; forward_kl_topk (the top-k forward KL) is declared so a config
# may name it, and refused until the engines return top-k log-probs
DISTILL_LOSSES: Registry[str] = Registry(
    "distillation loss", config_key="distillation.distillation_loss.loss_mode"
)
for _name in ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"):
    DISTILL_LOSSES.add(_name, KL_ESTIMATORS.canonical(_name))


@dataclass(frozen=True)
class DistillSpec:
    """The settings of the distillation term (`distillation.distillation_loss`)."""

    loss_mode: str = "k3"
    use_policy_gradient: bool = False
    loss_max_clamp: float | None = None
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    # the task's loss beside the term (verl's use_task_rewards), the term then weighted
    # by `coef`; without it the term is the whole loss (weight 1)
    with_task: bool = True
    coef: float = 1.0

    @property
    def weight(self) -> float:
        """The term's weight in the loss: `coef` beside the task's loss, else 1 (verl's)."""
        return self.coef if self.with_task else 1.0


def token_divergence(
    student: Tensor, teacher: Tensor, mask: Tensor, loss_mode: str = "k3"
) -> Tensor:
    """Each response token's divergence ``[batch, response_len]`` (0 on padding, which
    carries no gradient): `rayrl.algos.kl.kl_divergence` by the mode's estimator."""
    estimator = DISTILL_LOSSES.get(loss_mode)
    return kl_divergence(student, teacher.to(student.dtype), estimator, mask)


def distillation_loss(
    log_prob: Tensor,
    teacher_log_prob: Tensor,
    old_log_prob: Tensor,
    mask: Tensor,
    spec: DistillSpec,
    agg: LossAggregation | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The distillation term of one micro-batch and its metrics (see the module).

    ``log_prob`` is this forward's (with gradient), ``old_log_prob`` the sampling
    policy's (the policy gradient's ratio is against it)."""
    agg = agg or LossAggregation()
    divergence = token_divergence(log_prob, teacher_log_prob, mask, spec.loss_mode)
    real = divergence.detach()[mask.bool()]
    metrics = {
        "abs_loss": masked_mean(divergence.detach().abs(), mask),
        "reverse_kl": masked_mean((log_prob - teacher_log_prob).detach(), mask),
        "loss_max": real.max() if real.numel() else divergence.new_zeros(()),
    }
    if spec.loss_max_clamp is not None:
        divergence = divergence.clamp(-spec.loss_max_clamp, spec.loss_max_clamp)
    if not spec.use_policy_gradient:
        return agg(divergence, mask), metrics
    clip = PolicyLossConfig(
        clip_ratio_low=spec.clip_ratio_low, clip_ratio_high=spec.clip_ratio_high
    )
    loss, pg = ppo_policy_loss(
        log_prob, old_log_prob, -divergence.detach(), mask, config=clip, agg=agg
    )
    metrics.update(pg)
    return loss, metrics
