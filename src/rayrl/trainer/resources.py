"""What a run asks of the cluster: the resource pools a config implies.

The actor, rollout, reference and critic roles share one pool (the hybrid engine:
one process per bundle holds them); the rule-based reward runs in a small CPU pool.
Both reserve spare bundles by `resources.capacity_factor`, where replacements of the
workers of a lost node go.
"""

from __future__ import annotations

from rayrl.cluster.spec import PoolSpec
from rayrl.config.schema import RayRLConfig


def resolve_device(cfg: RayRLConfig, cluster_gpus: float) -> str:
    """`trainer.device=auto` means cuda when the cluster has GPUs, else cpu."""
    if cfg.trainer.device != "auto":
        return cfg.trainer.device
    return "cuda" if cluster_gpus > 0 else "cpu"


def pools_from_config(cfg: RayRLConfig, device: str) -> list[PoolSpec]:
    """One pool for the model roles (nnodes x n_gpus_per_node bundles), one for rewards."""
    res = cfg.resources
    bundle: dict[str, float] = {"CPU": float(res.cpus_per_worker)}
    if device == "cuda":
        bundle["GPU"] = 1.0
    pools = [
        PoolSpec(
            name="actor_rollout_ref",
            per_node=[cfg.trainer.n_gpus_per_node] * cfg.trainer.nnodes,
            bundle=bundle,
            strategy="STRICT_PACK",
            capacity_factor=res.capacity_factor,
            loader_workers=res.loader_workers,
        )
    ]
    # The reward worker's scoring processes are light: one reserved CPU for all of them.
    # It gets spares too, so that a lost node that held it is survived like any other.
    reward_bundle: dict[str, float] = {"CPU": 1.0}
    if cfg.reward_model.enable and device == "cuda":
        reward_bundle["GPU"] = 1.0
    pools.append(
        PoolSpec(
            name="reward", per_node=[1], bundle=reward_bundle, strategy="PACK",
            capacity_factor=res.capacity_factor,
        )
    )  # fmt: skip
    return pools
