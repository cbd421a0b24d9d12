"""What a run asks of the cluster: the resource pools a config implies.

The actor, rollout, reference and critic roles share one pool (the hybrid engine:
one process per bundle holds them); under `actor_rollout_ref.rollout.mode=async` the
rollout replicas have a pool of their own too (`rollout_pool_spec`, last in the
list). The reward has a pool of its own with `reward.workers_per_node` workers on every
node of the training pool (`reward_pool_spec`: its per-node group i on the node of the
training pool's group i, `PoolSpec.align_with`), each bundle `reward.cpus_per_worker`
CPUs and, for a reward model on GPUs, one GPU; or, on a CPU-only run of one actor rank
(`reward_colocated`), the reward runs in the actor's process, whose bundle then holds
the reward's CPUs too. The pools reserve spare bundles by `resources.capacity_factor`,
where replacements of the workers of a lost node go.

A CPU-only run that starts its own Ray gives it the logical CPUs its pools need when
the machine has fewer cores (`local_cpu_count`), up to `OVERSUBSCRIPTION` a core:
past that, `rayrl train` refuses the run and `rayrl plan` says it never fits.
"""

from __future__ import annotations

import math
import os

from rayrl.cluster.spec import PoolSpec
from rayrl.config.distill import teacher_pool_size
from rayrl.config.judge_mode import judge_enabled, judge_on_own_pool
from rayrl.config.schema import RayRLConfig
from rayrl.config.sft import SFTConfig


def resolve_device(cfg: RayRLConfig | SFTConfig, cluster_gpus: float) -> str:
    """`trainer.device=auto` means cuda when the cluster has GPUs, else cpu."""
    if cfg.trainer.device != "auto":
        return cfg.trainer.device
    return "cuda" if cluster_gpus > 0 else "cpu"


TRAIN_POOL = "actor_rollout_ref"
REWARD_POOL = "reward"


def reward_colocated(cfg: RayRLConfig, device: str) -> bool:
    """Whether the reward role runs in the actor's process (`reward.colocate`), which is
    safe on a CPU-only run of one actor rank scoring with a function or an HTTP service:
    no GPU and no reward model to share, no ranks to split the scoring over (one reward
    worker per node, `reward.workers_per_node=1`). The reward's calls then queue behind
    the actor's (scoring a batch takes milliseconds) and one worker process fewer starts."""
    return (
        cfg.reward.colocate
        and device == "cpu"
        and cfg.world_size == 1
        and cfg.reward.workers_per_node == 1
        and not cfg.reward_model.enable
    )


# `resources.cpus_per_worker=auto` on a GPU node: this share of its CPUs goes to the GPU
# workers (a third stays with Ray's own processes, the driver and the reward); too few
# CPUs starve a GPU worker's host side (kernel launches, the rollout's scheduler).
WORKER_CPU_SHARE = 0.65


def cpus_per_worker(cfg: RayRLConfig | SFTConfig, device: str, node_cpus: float | None) -> float:
    """The CPUs of one model worker's bundle: `resources.cpus_per_worker`, or for `auto`
    on a GPU run `WORKER_CPU_SHARE` of a node's CPUs (`node_cpus`: the smallest node
    that would hold workers; None when unknown) split among its `n_gpus_per_node`
    workers, at least 1; 1 on a CPU-only run."""
    value = cfg.resources.cpus_per_worker
    if value != "auto":
        return float(value)
    if device != "cuda" or not node_cpus:
        return 1.0
    return float(max(1, int(node_cpus * WORKER_CPU_SHARE // cfg.trainer.n_gpus_per_node)))


def node_cpus(totals: dict[str, dict[str, float]], device: str) -> float | None:
    """CPUs of the smallest node that can hold workers (one with GPUs on a GPU run),
    from per-node resource totals; None when no node qualifies."""
    cpus = [r.get("CPU", 0.0) for r in totals.values() if device != "cuda" or r.get("GPU", 0.0) > 0]
    return min(cpus) if cpus else None


def cluster_node_cpus(device: str) -> float | None:
    """`node_cpus` of the Ray cluster this process is connected to (None on a CPU run,
    whose worker CPUs do not depend on it, or when not connected)."""
    import ray

    if device != "cuda" or not ray.is_initialized():
        return None
    totals = {n["NodeID"]: n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")}
    return node_cpus(totals, device)


def pools_from_config(
    cfg: RayRLConfig, device: str, node_cpu_count: float | None = None
) -> list[PoolSpec]:
    """One pool for the model roles (nnodes x n_gpus_per_node bundles), one for rewards
    unless the reward is colocated with the actor (then the actor's bundle gets its CPU).
    `node_cpu_count` sizes `resources.cpus_per_worker=auto` (`cpus_per_worker`)."""
    res = cfg.resources
    colocated = reward_colocated(cfg, device)
    worker_cpus = cpus_per_worker(cfg, device, node_cpu_count)
    reward_cpus = float(cfg.reward.cpus_per_worker) if colocated else 0.0
    bundle: dict[str, float] = {"CPU": worker_cpus + reward_cpus}
    if device == "cuda":
        bundle["GPU"] = res.gpus_per_worker
    pools = [
        PoolSpec(
            name=TRAIN_POOL,
            per_node=[cfg.trainer.n_gpus_per_node] * cfg.trainer.nnodes,
            bundle=bundle,
            strategy="STRICT_PACK",
            capacity_factor=res.capacity_factor,
            loader_workers=res.loader_workers,
        )
    ]
    if not colocated:
        pools.append(reward_pool_spec(cfg, device))
    if judge_on_own_pool(cfg):
        pools.append(judge_pool_spec(cfg, device))
    if teacher_pool_size(cfg.distillation):
        pools.append(teacher_pool_spec(cfg, device, worker_cpus))
    if cfg.asynchronous:
        pools.append(rollout_pool_spec(cfg, device))
    return pools


def reward_pool_spec(cfg: RayRLConfig, device: str) -> PoolSpec:
    """The reward workers: `reward.workers_per_node` on each of the training pool's
    `trainer.nnodes` nodes, group i pinned to the node of the training pool's group i
    (`align_with`), so that each node's rows can be scored where they are. A bundle is
    `reward.cpus_per_worker` CPUs (the worker's scoring processes share them) and, for a
    reward model on GPUs, one GPU. Spares too, so that a lost node that held reward
    workers is survived like any other."""
    bundle: dict[str, float] = {"CPU": float(cfg.reward.cpus_per_worker)}
    if cfg.reward_model.enable and device == "cuda" and not judge_on_own_pool(cfg):
        bundle["GPU"] = 1.0
    return PoolSpec(
        name=REWARD_POOL,
        per_node=[cfg.reward.workers_per_node] * cfg.trainer.nnodes,
        bundle=bundle,
        strategy="STRICT_PACK",
        capacity_factor=cfg.resources.capacity_factor,
        align_with=TRAIN_POOL,
    )


JUDGE_POOL = "judge"


def judge_pool_spec(cfg: RayRLConfig, device: str) -> PoolSpec:
    """The judge's replicas (`reward_model.enable_resource_pool`): `n_gpus_per_node` on
    each of `reward_model.nnodes` nodes, a GPU each on a GPU run (else
    `reward.cpus_per_worker` CPUs), each serving the judge over HTTP."""
    rm = cfg.reward_model  # sizes checked at load (`config.reward_checks.check_judge_pool`)
    cpus = float(cfg.reward.cpus_per_worker)
    return model_pool(cfg, JUDGE_POOL, rm.n_gpus_per_node, rm.nnodes, cpus, device, 1.0)


def model_pool(
    cfg: RayRLConfig, name: str, per_node: int, nodes: int, cpus: float, device: str, gpus: float
) -> PoolSpec:
    """A pool of its own for a model's workers: `per_node` bundles on each of `nodes`
    nodes, packed, each of `cpus` CPUs and, on a GPU run, `gpus` GPUs."""
    bundle: dict[str, float] = {"CPU": cpus}
    if device == "cuda":
        bundle["GPU"] = gpus
    return PoolSpec(
        name=name,
        per_node=[per_node] * nodes,
        bundle=bundle,
        strategy="PACK",
        capacity_factor=cfg.resources.capacity_factor,
    )


TEACHER_POOL = "teacher"


def teacher_pool_spec(cfg: RayRLConfig, device: str, worker_cpus: float) -> PoolSpec:
    """The distillation teachers' own pool (`distillation.n_gpus_per_node` x `nnodes`
    > 0): a training worker's bundle each, the teachers FSDP-sharded over its ranks."""
    dist, gpus = cfg.distillation, cfg.resources.gpus_per_worker
    return model_pool(
        cfg, TEACHER_POOL, dist.n_gpus_per_node, dist.nnodes, worker_cpus, device, gpus
    )


def reward_layout(cfg: RayRLConfig, device: str) -> str:
    """Where the reward scores, in words (for `rayrl plan`): in the actor's process, or
    how many reward workers on which nodes, with what each holds."""
    if reward_colocated(cfg, device):
        return (
            "reward: in the actor's process (one CPU-only rank: reward.colocate), "
            f"{cfg.reward.num_workers} scoring process(es)"
        )
    spec = reward_pool_spec(cfg, device)
    per_node, nodes = cfg.reward.workers_per_node, cfg.trainer.nnodes
    if judge_on_own_pool(cfg):
        rm = cfg.reward_model
        holds = (
            f"a client of the LLM judge's pool: {rm.n_gpus_per_node} replica(s) on each of "
            f"{rm.nnodes} node(s), reward_model.enable_resource_pool"
        )
    elif judge_enabled(cfg):
        holds = "an LLM judge replica served in its process, asleep between scorings"
    elif cfg.reward_model.enable:
        holds = "a data-parallel rank of the reward model"
    elif cfg.reward.http.url:
        holds = "a client of reward.http.url"
    else:
        holds = f"{cfg.reward.num_workers} scoring process(es)"
    return (
        f"reward: {spec.world_size} worker(s), {per_node} on each of the {nodes} node(s) of "
        f"{TRAIN_POOL} (reward.workers_per_node; {spec.shape()} each, {holds}); the rows of "
        "the ranks on each node are scored by that node's reward workers"
    )


ROLLOUT_POOL = "rollout"


def rollout_bundle(cfg: RayRLConfig, device: str) -> dict[str, float]:
    """One rollout replica's bundle: `rollout.cpus_per_replica` CPUs and, on a GPU,
    `rollout.gpus_per_replica` of one."""
    pool = cfg.rollout
    bundle: dict[str, float] = {"CPU": float(pool.cpus_per_replica)}
    if device == "cuda":
        bundle["GPU"] = pool.gpus_per_replica
    return bundle


def rollout_pool_spec(cfg: RayRLConfig, device: str) -> PoolSpec:
    """The rollout replicas of `rollout.mode=async`: `rollout.n_gpus_per_node` per node
    on `rollout.nnodes` nodes, each node's bundles pinned to it (STRICT_PACK): a bundle
    lost with its node is never placed again behind the run's back; the rollout manager
    asks for a bundle of its own instead (`rayrl.trainer.async_rollout`)."""
    pool = cfg.rollout
    return PoolSpec(
        name=ROLLOUT_POOL,
        per_node=[pool.n_gpus_per_node] * pool.nnodes,
        bundle=rollout_bundle(cfg, device),
        strategy="STRICT_PACK",
    )


# A CPU-only run that starts its own Ray may give it more logical CPUs than the machine
# has cores (its workers then share the cores), up to this many per core. Sharing a
# core among a few workers costs little, as they mostly take turns (the trainer
# updates while the rollout waits, and the other way round); 64 rollout replicas on 2
# cores took 5 minutes a step, each waiting for a core nearly all the time. Past this,
# `rayrl train` refuses the run and `rayrl plan` says it never fits.
OVERSUBSCRIPTION = 4
# The keys that size each pool of `pools_from_config`: (bundles per node, nodes, CPUs each).
POOL_KEYS = {
    TRAIN_POOL: ("trainer.n_gpus_per_node", "trainer.nnodes", "resources.cpus_per_worker"),
    REWARD_POOL: ("reward.workers_per_node", "trainer.nnodes", "reward.cpus_per_worker"),
    ROLLOUT_POOL: ("rollout.n_gpus_per_node", "rollout.nnodes", "rollout.cpus_per_replica"),
    JUDGE_POOL: ("reward_model.n_gpus_per_node", "reward_model.nnodes", "reward.cpus_per_worker"),
    TEACHER_POOL: (
        "distillation.n_gpus_per_node",
        "distillation.nnodes",
        "resources.cpus_per_worker",
    ),
}


def local_cpu_count(specs: list[PoolSpec], cores: int, extra: float = 0.0) -> int | None:
    """The logical CPUs a local Ray of a CPU-only run starts with: the pools' CPUs
    (their bundles and spares) and `extra` CPUs of work outside the pools (Ray Data's
    tasks) when this machine's `cores` are fewer, so that a run of several roles
    (async training: the trainer, the reward and a rollout replica) starts on a laptop
    too, its workers sharing the cores; None when the cores hold them.

    Raises ResourcesUnsatisfiable when they need more than `OVERSUBSCRIPTION` logical
    CPUs a core: the message gives the numbers and the key to lower. `rayrl train` and
    `rayrl plan` both decide here."""
    need = extra + sum(_pool_cpus(s) for s in specs)
    if need > OVERSUBSCRIPTION * cores + 1e-9:
        from rayrl.cluster.guard import ResourcesUnsatisfiable

        raise ResourcesUnsatisfiable(_oversubscribed(specs, cores, need, extra), table="")
    return math.ceil(need) if need > cores else None


def _pool_cpus(spec: PoolSpec) -> float:
    return spec.bundle.get("CPU", 0.0) * (spec.world_size + spec.num_spares)


def _oversubscribed(specs: list[PoolSpec], cores: int, need: float, extra: float) -> str:
    """Why a CPU-only run cannot start on this machine: the CPUs of each pool, and
    what to lower."""
    parts = [f"{s.name} {_pool_cpus(s):g} ({_shape(s)})" for s in specs]
    if extra:
        parts.append(f"Ray Data's tasks {extra:g}")
    largest = max(specs, key=_pool_cpus)
    count_key, nodes_key, cpu_key = POOL_KEYS.get(
        largest.name, (f"the bundles of pool {largest.name!r}", "its nodes", "its CPUs")
    )
    nodes = f" x {nodes_key}={len(largest.per_node)}" if len(largest.per_node) > 1 else ""
    return (
        f"this CPU-only run needs {need:g} logical CPUs ({', '.join(parts)}) and this "
        f"machine has {cores} cores: a local run shares its cores among its workers up to "
        f"{OVERSUBSCRIPTION} logical CPUs a core ({OVERSUBSCRIPTION * cores} here), past which "
        "each worker waits for a core nearly all the time. Lower "
        f"{count_key}={largest.per_node[0]}{nodes} (or {cpu_key}), or run on a machine with "
        "more cores or on a cluster (resources.address)"
    )


def _shape(spec: PoolSpec) -> str:
    spares = f" + {spec.num_spares} spare(s)" if spec.num_spares else ""
    cpus = spec.bundle.get("CPU", 0.0)
    return f"{spec.world_size}{spares} x {cpus:g} CPU{'' if cpus == 1 else 's'}"


def local_ray_cpus(
    cfg: RayRLConfig | SFTConfig, specs: list[PoolSpec], extra: float = 0.0
) -> int | None:
    """`local_cpu_count` for a run of `cfg` that starts a local Ray on this machine:
    None unless it runs on CPUs (`trainer.device`, or `auto` on a machine without a
    GPU); raises ResourcesUnsatisfiable as it does."""
    device = cfg.trainer.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cpu":
        return None
    return local_cpu_count(specs, len(os.sched_getaffinity(0)), extra=extra)
