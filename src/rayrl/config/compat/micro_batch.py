"""verl's deprecated global micro-batch sizes, turned into today's per-GPU sizes.

Older verl scripts give `actor.ppo_micro_batch_size` (and the rollout's, the
reference's, the critic's and the reward model's) for all GPUs together. verl divides
it by the data-parallel size (the GPUs over the Ulysses size, which is 1 in rayrl) and
uses the quotient as the `*_per_gpu` size; giving both is an error, as in verl.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rayrl.config.errors import ConfigError

if TYPE_CHECKING:
    from rayrl.config.schema import RayRLConfig

ARR = "actor_rollout_ref"

# deprecated global key -> per-GPU key it sets (both dotted from the config's root)
GLOBAL_MICRO_BATCH: dict[str, str] = {
    f"{ARR}.actor.ppo_micro_batch_size": f"{ARR}.actor.ppo_micro_batch_size_per_gpu",
    f"{ARR}.rollout.log_prob_micro_batch_size": f"{ARR}.rollout.log_prob_micro_batch_size_per_gpu",
    f"{ARR}.ref.log_prob_micro_batch_size": f"{ARR}.ref.log_prob_micro_batch_size_per_gpu",
    "critic.ppo_micro_batch_size": "critic.ppo_micro_batch_size_per_gpu",
    "critic.forward_micro_batch_size": "critic.forward_micro_batch_size_per_gpu",
    "reward_model.micro_batch_size": "reward_model.micro_batch_size_per_gpu",
}


def _node(cfg: object, path: str) -> tuple[Any, str]:
    """The group that holds the dotted key `path`, and the key's last part."""
    *groups, leaf = path.split(".")
    for group in groups:
        cfg = getattr(cfg, group)
    return cfg, leaf


def resolve_global_micro_batches(
    cfg: RayRLConfig, world: int, warn: Callable[[str], None], dynamic: Callable[[str], bool]
) -> None:
    """Set each per-GPU size from its deprecated global one (`global // world`), with a
    deprecation note; the global key is cleared. `dynamic(key)` says whether that
    role sizes micro-batches by tokens (then verl allows both keys)."""
    for old, new in GLOBAL_MICRO_BATCH.items():
        node, leaf = _node(cfg, old)
        size = getattr(node, leaf)
        if size is None:
            continue
        new_node, new_leaf = _node(cfg, new)
        if getattr(new_node, new_leaf) is not None and not dynamic(old):
            if old == "critic.forward_micro_batch_size":  # follows ppo_micro_batch_size
                setattr(node, leaf, None)
                continue
            raise ConfigError(
                f"{old}={size} and {new}={getattr(new_node, new_leaf)} are both set; remove "
                f"{old} (verl's deprecated global size: only *_per_gpu is supported)"
            )
        per_gpu = size // world
        if per_gpu < 1:
            raise ConfigError(
                f"{old}={size} is verl's deprecated size for all {world} GPUs together: "
                f"{size} // {world} = 0 per GPU; set {new} instead"
            )
        setattr(new_node, new_leaf, per_gpu)
        setattr(node, leaf, None)
        warn(
            f"{old}={size} is verl's deprecated global micro-batch size: {size} // {world} "
            f"GPUs = {per_gpu} per GPU, so {new}={per_gpu}"
        )
