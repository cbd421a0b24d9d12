"""The checks of asynchronous training's config at load (`check_async`, called by
`rayrl.config.validate`): the rollout pool (verl's top-level `rollout` group) and the
`async_training` group (`rayrl.config.async_training`), against the rest of the
config."""

from __future__ import annotations

from collections.abc import Callable

from rayrl.config.async_training import AsyncTrainingConfig
from rayrl.config.errors import ConfigError
from rayrl.config.schema import RayRLConfig

__all__ = ["check_async"]


def check_async(cfg: RayRLConfig, warn: Callable[[str], None]) -> None:
    """`actor_rollout_ref.rollout.mode=async`: the rollout pool and `async_training.*`."""
    share = cfg.resources.gpus_per_worker
    if not 0 < share <= 1:
        raise ConfigError(
            f"resources.gpus_per_worker={share} must be in (0, 1]: the GPU share of each "
            "training worker (0.5 lets a rollout replica share its GPU)"
        )
    pool, a = cfg.rollout, cfg.async_training
    if cfg.actor_rollout_ref.rollout.mode != "async":
        if pool.n_gpus_per_node > 0:
            raise ConfigError(
                f"rollout.n_gpus_per_node={pool.n_gpus_per_node} declares a rollout pool, "
                "which only asynchronous training uses: set actor_rollout_ref.rollout."
                "mode=async too, or leave rollout.n_gpus_per_node at 0"
            )
        return
    _check_ranges(a)
    if not cfg.asynchronous:
        warn(
            "actor_rollout_ref.rollout.mode=async without a rollout pool "
            "(rollout.n_gpus_per_node=0): training stays synchronous, the rollout serving "
            "each step (agent loops included) as verl's main_ppo does; for asynchronous "
            "training declare the pool: rollout.nnodes, rollout.n_gpus_per_node"
        )
        return
    for key in ("nnodes", "n_gpus_per_node", "cpus_per_replica"):
        if getattr(pool, key) < 1:
            raise ConfigError(f"rollout.{key}={getattr(pool, key)} must be at least 1")
    if not 0 < pool.gpus_per_replica <= 1:
        raise ConfigError(
            f"rollout.gpus_per_replica={pool.gpus_per_replica} must be in (0, 1]: a replica "
            "is one process on one GPU (0.5 shares a GPU with another process)"
        )
    tp = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
    if tp > 1 and pool.n_gpus_per_node % tp:
        raise ConfigError(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} splits each rollout "
            f"replica over {tp} GPUs of one node, but rollout.n_gpus_per_node="
            f"{pool.n_gpus_per_node} is no multiple of it; make it one (e.g. "
            f"rollout.n_gpus_per_node={tp * max(1, pool.n_gpus_per_node // tp)})"
        )
    if tp > 1 and a.weight_transport == "collective":
        raise ConfigError(
            "async_training.weight_transport=collective broadcasts to one rank a replica; "
            f"replicas of tensor_model_parallel_size={tp} ranks take the object store's "
            "copy (async_training.weight_transport=object_store)"
        )
    declared = pool.nnodes * pool.n_gpus_per_node // max(tp, 1)
    if pool.max_replicas is not None and pool.max_replicas < declared:
        raise ConfigError(
            f"rollout.max_replicas={pool.max_replicas} is below the declared replicas "
            f"(rollout.nnodes x rollout.n_gpus_per_node / tensor_model_parallel_size = "
            f"{declared}); raise it or leave it "
            "unset (null)"
        )
    alg = cfg.algorithm
    if alg.filter_groups.enable or alg.adv_estimator == "remax":
        what = "dynamic sampling" if alg.filter_groups.enable else "remax's greedy baselines"
        raise ConfigError(
            f"actor_rollout_ref.rollout.mode=async does not support {what} yet: they generate "
            "again inside the step; use rollout.mode=sync for them"
        )


def _check_ranges(a: AsyncTrainingConfig) -> None:
    """The `async_training` keys' ranges: out of range is an error with or without a
    rollout pool (a config that trains synchronously today may declare one tomorrow)."""
    if a.staleness_threshold < 0:
        raise ConfigError(
            f"async_training.staleness_threshold={a.staleness_threshold} must be >= 0 "
            "(0: every sample comes from the policy it trains)"
        )
    if a.trigger_parameter_sync_step < 1:
        raise ConfigError(
            f"async_training.trigger_parameter_sync_step={a.trigger_parameter_sync_step} "
            "must be at least 1 (trainer steps between weight updates of the replicas)"
        )
    if a.prompts_per_call is not None and a.prompts_per_call < 1:
        raise ConfigError(f"async_training.prompts_per_call={a.prompts_per_call} must be >= 1")
    if a.calls_per_replica < 1:
        raise ConfigError(
            f"async_training.calls_per_replica={a.calls_per_replica} must be >= 1 (replica "
            "calls in flight on one replica at once)"
        )
    if a.weight_sync_timeout_s is not None and not a.weight_sync_timeout_s > 0:
        raise ConfigError(
            f"async_training.weight_sync_timeout_s={a.weight_sync_timeout_s} must be > 0 "
            "seconds, or null (trainer.stage_timeout_s)"
        )
