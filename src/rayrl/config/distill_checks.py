"""On-policy distillation's checks at load time (`distillation.*`, `rayrl.config.distill`):
each refusal names the key to change."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rayrl.config.distill import teachers
from rayrl.config.errors import ConfigError

if TYPE_CHECKING:
    from rayrl.config.schema import RayRLConfig

__all__ = ["DISTILL_LOSS_MODES", "check_distillation"]

# `rayrl.algos.distill.DISTILL_LOSSES`' names (a test holds them equal)
DISTILL_LOSS_MODES = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl", "forward_kl_topk")
KEY = "distillation.distillation_loss"


def check_distillation(cfg: RayRLConfig) -> None:
    """`distillation.enabled`'s settings: a teacher for every row, a loss that trains
    (verl's refusal of a backpropagated k1, whose gradient does not see the teacher),
    a pool with ranks."""
    dist = cfg.distillation
    if not dist.enabled:
        return
    loss = dist.distillation_loss
    if loss.loss_mode not in DISTILL_LOSS_MODES:
        raise ConfigError(
            f"{KEY}.loss_mode={loss.loss_mode!r} is not a distillation loss; choose one of "
            f"{', '.join(DISTILL_LOSS_MODES)}"
        )
    if loss.loss_mode in ("k1", "kl") and not loss.use_policy_gradient:
        raise ConfigError(
            f"{KEY}.loss_mode={loss.loss_mode} backpropagated directly trains nothing toward "
            "the teacher (the gradient of log p_student - log p_teacher does not depend on "
            f"the teacher): set {KEY}.use_policy_gradient=true, or loss_mode=k3"
        )
    if loss.loss_mode == "forward_kl_topk":
        raise ConfigError(
            f"{KEY}.loss_mode=forward_kl_topk: rayrl's engines do not return the teacher's "
            "top-k log-probs yet (only each sampled token's); use loss_mode=k3 (supervised "
            "reverse KL) or k1 with use_policy_gradient=true"
        )
    for name in ("clip_ratio_low", "clip_ratio_high", "distillation_loss_coef"):
        if getattr(loss, name) < 0:
            raise ConfigError(f"{KEY}.{name} must be >= 0, got {getattr(loss, name)}")
    if loss.loss_max_clamp is not None and loss.loss_max_clamp <= 0:
        raise ConfigError(f"{KEY}.loss_max_clamp must be > 0 (or null), got {loss.loss_max_clamp}")
    try:
        found = teachers(dist)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if len(found) > 1 and not dist.teacher_key:
        raise ConfigError(
            "distillation.teacher_key is empty: with several teachers, name the batch column "
            "(e.g. data_source) whose value picks each row's teacher"
        )
    if dist.nnodes > 0 and dist.n_gpus_per_node < 1:
        raise ConfigError(
            f"distillation.n_gpus_per_node={dist.n_gpus_per_node} with nnodes={dist.nnodes}: "
            "the teachers' pool needs at least one rank per node (or nnodes=0 to run them "
            "in the actor's processes)"
        )
