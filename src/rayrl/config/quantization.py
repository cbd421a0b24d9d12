"""An FP8 rollout's check and default (``actor_rollout_ref.rollout.quantization``).

The native engine keeps the dense layers' matrices in FP8 (`rayrl.rollout.native.fp8`),
so the rollout samples from a policy slightly off the one the actor trains. As verl,
slime and NeMo-RL do with FP8 rollouts, the loss then weighs each token by its
truncated importance ratio (`algorithm.rollout_correction.rollout_is=token`) unless the
config chose otherwise. The hf engine has no FP8 path: naming it is refused here, and
`auto` resolving to it where the rollout engine is chosen (`rayrl.rollout.base`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

from rayrl.config.errors import ConfigError
from rayrl.config.schema import RayRLConfig

__all__ = ["QUANTIZATIONS", "check_quantization", "with_quantized_correction"]

QUANTIZATIONS = (None, "fp8")
KEY = "actor_rollout_ref.rollout.quantization"


def check_quantization(cfg: RayRLConfig) -> None:
    """ConfigError for a rollout engine without the quantization asked for (the value
    itself is one of `QUANTIZATIONS`: `rayrl.config.validate.CHOICES`)."""
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.quantization and rollout.name == "hf":
        raise ConfigError(
            f"{KEY}={rollout.quantization} needs the native rollout engine; "
            "actor_rollout_ref.rollout.name=hf has no FP8 path: set it to native (or auto)"
        )


def with_quantized_correction(cfg: RayRLConfig, print_fn: Callable[[str], None]) -> RayRLConfig:
    """``cfg``, with token-level truncated importance sampling when the rollout is
    quantized, the rollout's log-probs are kept, and ``rollout_is`` is unset."""
    rollout, correction = cfg.actor_rollout_ref.rollout, cfg.algorithm.rollout_correction
    if not rollout.quantization or correction.rollout_is is not None:
        return cfg
    if not rollout.calculate_log_probs:
        print_fn(
            f"{KEY}={rollout.quantization}: the rollout's log-probs are not kept "
            "(rollout.calculate_log_probs=false), so no importance sampling corrects the "
            "quantized rollout"
        )
        return cfg
    cfg = copy.deepcopy(cfg)
    cfg.algorithm.rollout_correction.rollout_is = "token"
    print_fn(
        f"{KEY}={rollout.quantization}: the rollout samples from a quantized policy, so the "
        "loss weighs tokens by truncated importance ratios (algorithm.rollout_correction."
        f"rollout_is=token, cap rollout_is_threshold={correction.rollout_is_threshold})"
    )
    return cfg
