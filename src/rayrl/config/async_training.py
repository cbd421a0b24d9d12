"""Asynchronous training's config groups: verl 0.9.1's top-level `rollout` group (the
pool of rollout replicas) and its `async_training` group, read under
`actor_rollout_ref.rollout.mode=async` (`rayrl.trainer.async_ppo`), checked at config
load (`rayrl.config.async_checks`)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["WEIGHT_TRANSPORTS", "AsyncTrainingConfig", "RolloutPoolConfig"]


@dataclass
class RolloutPoolConfig:
    """The pool of rollout replicas under `actor_rollout_ref.rollout.mode=async`: verl
    0.9.1's top-level `rollout` group (its fully_async_policy and one_step_off_policy
    recipes), one replica per GPU (a process per replica on a CPU), plus rayrl's keys
    for fractional bundles and elastic growth."""

    nnodes: int = 1
    # replicas per node. 0 (the default): no pool of its own, and rollout.mode=async
    # means what it means in verl's main_ppo (the rollout serves the steps, agent loops
    # included: in rayrl the synchronous hybrid engine); >= 1 makes it asynchronous
    # training, as verl's fully_async_policy and one_step_off_policy recipes do
    n_gpus_per_node: int = 0
    gpus_per_replica: float = 1.0  # a fraction shares a GPU (0.5: beside the trainer)
    cpus_per_replica: int = 1
    # replicas the pool grows to when the cluster has room for more (a node joins, an
    # autoscaler adds one); None: nnodes x n_gpus_per_node
    max_replicas: int | None = None


# How policy versions reach asynchronous training's replicas (`weight_transport`)
WEIGHT_TRANSPORTS = ("object_store", "collective")


@dataclass
class AsyncTrainingConfig:
    """verl 0.9.1's `async_training` group (experimental/fully_async_policy), read
    under `actor_rollout_ref.rollout.mode=async` (`rayrl.trainer.async_ppo`)."""

    # How far behind the trainer a sample's policy may be: samples of policy version v
    # train at step s only if s - v <= ceil(staleness_threshold) (with
    # trigger_parameter_sync_step N > 1: N x (ceil + 1) - 1); a fraction, as verl's,
    # lets that share of a batch be generated ahead of each policy version
    staleness_threshold: float = 0.1
    trigger_parameter_sync_step: int = 4  # trainer steps per weight update of the replicas
    # new weights reach sequences in flight: true, they continue under them (each token
    # keeps the version that sampled it); false, they finish under their own version,
    # and are aborted and re-queued when they could no longer be trained
    partial_rollout: bool = True
    prompts_per_call: int | None = None  # rayrl: prompts per replica call; None: a batch / replicas
    # rayrl: replica calls in flight on one replica at once; their samples share its
    # engine's batch (continuous batching across calls), so a call's long tail never
    # leaves the replica idle; calls go to the least-loaded replica
    calls_per_replica: int = 2
    # rayrl: how each policy version reaches the replicas: object_store (each replica
    # fetches the packed buckets) or collective (actor rank 0 broadcasts them to the
    # replicas over a group of their own: gloo on CPU, NCCL on GPUs; a replica that
    # misses the broadcast fetches that version from the object store instead)
    weight_transport: str = "object_store"
    # rayrl: the bound on forming the collective group and on each broadcast, seconds;
    # None: trainer.stage_timeout_s (300 when that is None too)
    weight_sync_timeout_s: float | None = None
