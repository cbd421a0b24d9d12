"""Starting a PPO run's roles: which processes hold which roles, created and initialised
side by side, and where they landed.

The hybrid group holds the actor (rollout and reference in its engine), the critic when
the algorithm has one, and, on a CPU-only run of one actor rank (`reward_colocated`), the
reward; otherwise the reward has its own small group. Both start at once
(`controller.start_groups`); the hybrid's ranks form a process group through the group's
one formation path.
"""

from __future__ import annotations

from typing import Any

from rayrl.cluster.pool import ResourcePool
from rayrl.controller import WorkerGroup, colocate, start_groups
from rayrl.trainer.ray_session import debug_env
from rayrl.trainer.resources import reward_colocated
from rayrl.workers import ActorRolloutRefWorker, CriticWorker, RewardWorker

__all__ = ["print_placement", "start_roles"]


def start_roles(trainer: Any, device: str) -> None:
    """`trainer`'s hybrid actor (with the critic and, where `reward_colocated`, the reward in
    its processes) and the reward worker, created and initialised concurrently; the
    hybrid's ranks form a process group (the group forms it, generation by
    generation, before the roles build engines; one rank has no peers and forms none)."""
    cfg, res = trainer.cfg, trainer.cfg.resources
    common = {"config": cfg, "model_path": trainer.model_path, "total_steps": trainer.total_steps()}
    reward = (RewardWorker, {"config": cfg, "tokenizer_path": trainer.model_path})
    roles = {"actor": (ActorRolloutRefWorker, {**common, "with_ref": trainer.use_ref})}
    if trainer.use_critic:
        roles["critic"] = (CriticWorker, common)
    if reward_colocated(cfg, device):
        roles["reward"] = reward
    hybrid, init = _new_group(trainer, roles, trainer.pools[0], "actor_rollout_ref")
    if hybrid.world_size > 1:
        init["backend"] = "nccl" if device == "cuda" else "gloo"
    starts = [(hybrid, init)]
    if "reward" not in roles:
        starts.append(_new_group(trainer, {"reward": reward}, trainer.pools[1], "reward"))
    start_groups(
        starts,
        create_timeout_s=res.create_timeout_s,
        init_timeout_s=res.init_timeout_s,
        init_retries=res.init_retries,
    )
    trainer.hybrid = hybrid
    trainer.actor = hybrid.view("actor") if len(roles) > 1 else hybrid
    trainer.critic = hybrid.view("critic") if trainer.use_critic else None
    trainer.reward = hybrid.view("reward") if "reward" in roles else starts[1][0]


def _new_group(
    trainer: Any, roles: dict[str, tuple[type, dict]], pool: ResourcePool, name: str
) -> tuple[WorkerGroup, dict]:
    """A group for `roles` (one class, or several fused) on `pool`, and its init
    kwargs (the process group's timeout among them); not started yet."""
    if len(roles) == 1:
        [(cls, init)] = roles.values()
    else:
        cls = colocate({role: c for role, (c, _) in roles.items()})
        init = {role: kwargs for role, (_, kwargs) in roles.items()}
    env = debug_env(trainer.cfg)
    group = WorkerGroup(
        cls,
        pool.bundles,
        role=name,
        run=trainer.run,
        kv=trainer.kv,
        pool=pool,
        runtime_env={"env_vars": env} if env else None,
        usage_interval_s=trainer.cfg.trainer.usage_interval_s,
    )
    trainer.groups.append(group)
    group.stage_timeout_s = trainer.cfg.trainer.stage_timeout_s or None
    return group, {**init, "pg_timeout_s": trainer.cfg.actor_rollout_ref.nccl_timeout}


def print_placement(trainer: Any) -> None:
    """Where each group runs (and, with `trainer.debug`, each group's debugger state)."""
    for group in trainer.groups:
        nodes = [str(info.get("node_id") or "?")[:8] for info in group.infos]
        roles = list(getattr(group.worker_cls, "ROLES", ()))
        holds = f" (roles {', '.join(roles)} in each)" if roles else ""
        trainer.print(
            f"{group.role}: {group.world_size} worker(s){holds} on node(s) {', '.join(nodes)}"
        )
    if trainer.cfg.trainer.debug:
        import ray

        for group in trainer.groups:
            state = ray.get(group.actors[0].debugger_state.remote())
            trainer.print(
                f"Ray debugger in {group.role} rank 0: RAY_DEBUG={state['RAY_DEBUG']}, "
                f"post-mortem {'on' if state['post_mortem'] else 'off'}, breakpoint() -> "
                f"{state['breakpoint'] or state['breakpointhook']}"
            )
        trainer.print(
            "breakpoint() in a worker method pauses it; an exception stops there for "
            "post-mortem. Attach as the README's 'Debugging workers' says."
        )
