"""Cross-field rules of a config, checked before any resource is reserved.

The batch-size chain of a step (verl's semantics): `data.train_batch_size` prompts,
each sampled `rollout.n` times; the samples split into mini-batches of
`ppo_mini_batch_size` prompts (x n samples), each mini-batch splits evenly over the
data-parallel ranks, and each rank's share splits into micro-batches of
`ppo_micro_batch_size_per_gpu` samples. Every message carries the actual numbers.
"""

from __future__ import annotations

from rayrl.config.load import ConfigError
from rayrl.config.schema import RayRLConfig

CHOICES = {
    "trainer.device": ("auto", "cpu", "cuda"),
    "actor_rollout_ref.rollout.engine": ("hf", "native"),
    "data.truncation": ("error", "left", "right"),
    "actor_rollout_ref.actor.optim.lr_scheduler": ("constant", "cosine"),
    "critic.optim.lr_scheduler": ("constant", "cosine"),
    "algorithm.kl_ctrl.type": ("fixed", "adaptive"),
    "actor_rollout_ref.model.dtype": ("auto", "float32", "bfloat16", "float16"),
}


def _get(cfg: RayRLConfig, path: str):
    obj = cfg
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def check_choices(cfg: RayRLConfig) -> None:
    for path, allowed in CHOICES.items():
        value = _get(cfg, path)
        if value not in allowed:
            raise ConfigError(f"{path}={value!r} is not one of {', '.join(allowed)}")


def check_positive(cfg: RayRLConfig) -> None:
    for path in (
        "trainer.nnodes",
        "trainer.n_gpus_per_node",
        "data.train_batch_size",
        "data.max_prompt_length",
        "data.max_response_length",
        "actor_rollout_ref.rollout.n",
        "actor_rollout_ref.actor.ppo_mini_batch_size",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        "actor_rollout_ref.actor.ppo_epochs",
    ):
        value = _get(cfg, path)
        if value < 1:
            raise ConfigError(f"{path}={value} must be at least 1")
    if cfg.resources.capacity_factor < 1.0:
        raise ConfigError(
            f"resources.capacity_factor={cfg.resources.capacity_factor} must be >= 1.0 "
            "(1.0 reserves no spare bundles; 1.25 reserves a spare for every 4 workers)"
        )


def check_batch_chain(
    role: str, prompts: int, n: int, mini: int, micro: int, world: int, dynamic: bool
) -> None:
    """Prompts x n samples -> mini-batches -> ranks -> micro-batches, each split exact."""
    if prompts % mini:
        raise ConfigError(
            f"data.train_batch_size={prompts} prompts do not split into mini-batches of "
            f"{role}.ppo_mini_batch_size={mini} prompts ({prompts} % {mini} = {prompts % mini}); "
            f"use a ppo_mini_batch_size that divides {prompts}"
        )
    samples = mini * n
    if samples % world:
        raise ConfigError(
            f"a mini-batch of {mini} prompts x rollout.n={n} = {samples} samples does not "
            f"split over {world} data-parallel ranks (trainer.nnodes x trainer.n_gpus_per_node); "
            f"{samples} % {world} = {samples % world}"
        )
    per_rank = samples // world
    if not dynamic and per_rank % micro:
        raise ConfigError(
            f"each rank's share of a mini-batch, {samples} samples / {world} ranks = {per_rank}, "
            f"does not split into micro-batches of {role}.ppo_micro_batch_size_per_gpu={micro} "
            f"({per_rank} % {micro} = {per_rank % micro}); use a micro-batch size dividing {per_rank} "
            f"or set {role}.use_dynamic_bsz=true"
        )


def critic_enabled(cfg: RayRLConfig) -> bool:
    if cfg.critic.enable is not None:
        return cfg.critic.enable
    return cfg.algorithm.adv_estimator == "gae"


def validate_config(cfg: RayRLConfig) -> None:
    """Raise ConfigError for the first rule the config breaks."""
    check_choices(cfg)
    check_positive(cfg)
    actor, n = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout.n
    prompts, world = cfg.data.train_batch_size, cfg.world_size
    check_batch_chain(
        "actor_rollout_ref.actor",
        prompts,
        n,
        actor.ppo_mini_batch_size,
        actor.ppo_micro_batch_size_per_gpu,
        world,
        actor.use_dynamic_bsz,
    )
    if critic_enabled(cfg):
        critic = cfg.critic
        check_batch_chain(
            "critic",
            prompts,
            n,
            critic.ppo_mini_batch_size,
            critic.ppo_micro_batch_size_per_gpu,
            world,
            False,
        )
    if cfg.algorithm.adv_estimator in ("grpo", "rloo") and n < 2:
        raise ConfigError(
            f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} compares the samples of one "
            f"prompt, but actor_rollout_ref.rollout.n={n}; set rollout.n to 2 or more"
        )
