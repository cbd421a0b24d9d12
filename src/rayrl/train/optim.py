"""Optimizer and learning-rate schedule of the training engine.

`OptimSpec` holds the settings (the field names of the config's ``*.optim`` group, so
``OptimSpec.from_config(cfg.actor_rollout_ref.actor.optim)`` works); `build_optimizer`
makes AdamW over the trainable parameters and `build_lr_scheduler` a `LambdaLR` whose
multiplier comes from the `LR_SCHEDULES` registry (``constant``, ``cosine``), both with
an optional linear warmup.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from rayrl.registry import Registry

logger = logging.getLogger(__name__)

__all__ = [
    "LR_SCHEDULES",
    "OptimSpec",
    "build_lr_scheduler",
    "build_optimizer",
    "nonfinite_gradients",
    "warn_nonfinite_gradients",
]

# name -> f(step, warmup_steps, total_steps, min_lr_ratio, num_cycles) -> LR multiplier
ScheduleFn = Callable[[int, int, int, float, float], float]
LR_SCHEDULES: Registry[ScheduleFn] = Registry("LR schedule", config_key="*.optim.lr_scheduler_type")


@dataclass
class OptimSpec:
    """AdamW and LR-schedule settings.

    Attributes:
        lr: peak learning rate.
        betas, eps, weight_decay: AdamW's.
        lr_scheduler: a name in `LR_SCHEDULES` (``constant`` or ``cosine``).
        warmup_steps: steps of linear warmup from 0 to ``lr``.
        min_lr_ratio: the cosine schedule decays to ``lr * min_lr_ratio``.
        num_cycles: cosine cycles over the run after warmup (0.5: one half-cosine from
            ``lr`` down to the minimum, verl's default).
        grad_clip: max gradient norm; 0 or None disables clipping (the norm is still
            measured, so non-finite steps are still skipped).
    """

    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    lr_scheduler: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    num_cycles: float = 0.5
    grad_clip: float | None = 1.0

    def __post_init__(self) -> None:
        beta1, beta2 = self.betas  # a list from YAML becomes the pair of floats
        self.betas = (float(beta1), float(beta2))
        LR_SCHEDULES.canonical(self.lr_scheduler)  # fail early with the valid names
        if self.lr < 0 or self.warmup_steps < 0:
            raise ValueError(
                f"optim: lr ({self.lr}) and warmup_steps ({self.warmup_steps}) must be >= 0."
            )

    @classmethod
    def from_config(cls, config: Any) -> OptimSpec:
        """Read the fields of `OptimSpec` from any object or mapping that has them."""
        names = [f.name for f in dataclasses.fields(cls)]
        if isinstance(config, dict):
            values = {k: config[k] for k in names if k in config}
        else:
            values = {k: getattr(config, k) for k in names if hasattr(config, k)}
        return cls(**values)


@LR_SCHEDULES.register("constant")
def _constant(step: int, warmup: int, total: int, min_ratio: float, cycles: float) -> float:
    return min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0


@LR_SCHEDULES.register("cosine")
def _cosine(step: int, warmup: int, total: int, min_ratio: float, cycles: float) -> float:
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    wave = max(0.0, 0.5 * (1.0 + math.cos(math.pi * 2.0 * cycles * progress)))
    return min_ratio + (1.0 - min_ratio) * wave


class _Multiplier:
    """A picklable LR multiplier (LambdaLR saves callable objects' attributes)."""

    def __init__(
        self, name: str, warmup: int, total: int, min_ratio: float, cycles: float = 0.5
    ) -> None:
        self.name, self.warmup, self.total, self.min_ratio = name, warmup, total, min_ratio
        self.cycles = cycles

    def __call__(self, step: int) -> float:
        fn = LR_SCHEDULES.get(self.name)
        return fn(step, self.warmup, self.total, self.min_ratio, self.cycles)


def build_optimizer(
    params: Iterable[torch.nn.Parameter], spec: OptimSpec, fused: bool = False
) -> torch.optim.AdamW:
    """AdamW over the parameters that require gradients; ``fused`` (for GPUs) steps in
    one kernel per group with no parameter-sized temporaries."""
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        raise ValueError("the model has no trainable parameters (all requires_grad=False).")
    return torch.optim.AdamW(
        trainable,
        lr=spec.lr,
        betas=spec.betas,
        eps=spec.eps,
        weight_decay=spec.weight_decay,
        fused=fused or None,
    )


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, spec: OptimSpec, total_steps: int | None
) -> LambdaLR:
    """`LambdaLR` following ``spec.lr_scheduler``; ``total_steps`` is needed by cosine."""
    name = LR_SCHEDULES.canonical(spec.lr_scheduler)
    if name == "cosine" and not total_steps:
        raise ValueError(
            "the cosine LR schedule needs total_steps (the number of training steps); "
            "pass total_steps to TrainEngine or use lr_scheduler='constant'."
        )
    multiplier = _Multiplier(
        name, spec.warmup_steps, int(total_steps or 0), spec.min_lr_ratio, spec.num_cycles
    )
    return LambdaLR(optimizer, multiplier)


def nonfinite_gradients(model: torch.nn.Module) -> list[str]:
    """Names of the parameters whose gradient (this rank's shard) has a NaN or inf."""
    names = []
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is None:
            continue
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        if not bool(torch.isfinite(local).all()):
            names.append(name)
    return names


def warn_nonfinite_gradients(model: torch.nn.Module, norm: float, skipped: int) -> None:
    """Log which parameters made the gradient norm non-finite (the step is skipped)."""
    names = nonfinite_gradients(model)
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    logger.warning(
        "gradient norm %s: optimizer step skipped (%d skipped so far). Non-finite gradients "
        "on this rank in %s. Check the loss inputs (advantages, old/ref log-probs) for NaN "
        "and lower the learning rate if the weights diverged.",
        norm,
        skipped,
        shown or "no parameter of this rank (another rank's shard)",
    )
