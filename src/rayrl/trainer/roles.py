"""Starting a PPO run's roles: which processes hold which roles, created and initialised
side by side, and where they landed.

The hybrid group holds the actor (rollout and reference in its engine), the critic when
the algorithm has one, and, on a CPU-only run of one actor rank (`reward_colocated`), the
reward; otherwise the reward has its own group, `reward.workers_per_node` workers on
each node of the hybrid's (`rayrl.trainer.resources.reward_pool_spec`), which the step
calls with its rows split by node (`rayrl.trainer.scoring`). Both start at once
(`controller.start_groups`); the hybrid's ranks form a process group through the group's
one formation path. `start_roles` returns the started groups as a `Roles` value.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from rayrl.cluster.kv import KVStore
from rayrl.cluster.pool import ResourcePool
from rayrl.config.schema import RayRLConfig
from rayrl.config.sft import SFTConfig
from rayrl.controller import WorkerGroup, colocate, start_groups
from rayrl.controller.layout import DataLayout
from rayrl.trainer.protocols import ActorRole, CriticRole, RewardRole, TeacherRole, TrainRole
from rayrl.trainer.ray_session import debug_env
from rayrl.trainer.resources import JUDGE_POOL, TEACHER_POOL, reward_colocated
from rayrl.workers import ActorRolloutRefWorker, CriticWorker, RewardWorker, TeacherWorker

__all__ = ["GroupEnv", "Roles", "new_group", "print_placement", "start_roles"]


@dataclass(frozen=True)
class GroupEnv:
    """What every group of a run is made with: the run's name and KV store, the
    process-group timeout and the watchdog's and usage sampler's settings."""

    run: str
    kv: KVStore
    debug_env: dict[str, str] = field(default_factory=dict)
    usage_interval_s: float = 0.5
    stage_timeout_s: float | None = None
    pg_timeout_s: float | None = None


@dataclass(frozen=True)
class Roles:
    """A PPO run's started roles: the hybrid group, the views the step calls through
    (the actor, the critic or None, the reward), and every group the run owns."""

    hybrid: WorkerGroup
    actor: ActorRole  # the hybrid group, or its actor view when roles are fused
    critic: CriticRole | None
    reward: RewardRole  # a group of its own, or the hybrid's reward view
    groups: list[WorkerGroup]
    # distillation's teachers: the hybrid's teacher view, a group of their own, or None
    teacher: TeacherRole | None = None


def start_roles(
    cfg: RayRLConfig,
    env: GroupEnv,
    pools: list[ResourcePool],
    device: str,
    *,
    model_path: str,
    total_steps: int,
    use_ref: bool,
    use_critic: bool,
) -> Roles:
    """The hybrid actor (with the critic and, where `reward_colocated`, the reward in its
    processes), the reward worker and, with on-policy distillation, the teachers (in the
    actor's processes, or on their own pool), created and initialised concurrently; the hybrid's
    ranks form a process group (the group forms it, generation by generation, before
    the roles build engines; one rank has no peers and forms none)."""
    res = cfg.resources
    common = {"config": cfg, "model_path": model_path, "total_steps": total_steps}
    reward = (RewardWorker, {"config": cfg, "tokenizer_path": model_path})
    roles = {"actor": (ActorRolloutRefWorker, {**common, "with_ref": use_ref})}
    if use_critic:
        roles["critic"] = (CriticWorker, common)
    if reward_colocated(cfg, device):
        roles["reward"] = reward
    teacher_pool = next((p for p in pools if p.spec.name == TEACHER_POOL), None)
    if cfg.distillation.enabled and teacher_pool is None:  # in the actor's processes
        roles["teacher"] = (TeacherWorker, {"config": cfg})
    hybrid, init = new_group(roles, pools[0], "actor_rollout_ref", env)
    starts = [with_backend(hybrid, init, device)]
    # replicas of their own, before the reward workers, which find their addresses in
    # the run's KV store (`rayrl.workers.judge.RemoteJudge`)
    judges = start_judges(cfg, env, pools)
    if "reward" not in roles:
        starts.append(new_group({"reward": reward}, pools[1], "reward", env))
    teachers: WorkerGroup | None = None  # on a pool of their own
    if teacher_pool is not None:
        own = new_group({"teacher": (TeacherWorker, {"config": cfg})}, teacher_pool, "teacher", env)
        starts.append(with_backend(*own, device))
        teachers = own[0]
    try:
        start_groups(
            starts,
            create_timeout_s=res.create_timeout_s,
            init_timeout_s=res.init_timeout_s,
            init_retries=res.init_retries,
        )
    except BaseException:
        if judges is not None:
            judges.shutdown()
        raise
    # The groups bind their worker classes' methods when they start (`bind_methods`):
    # the casts state which role protocol each one serves.
    started = Roles(
        hybrid=hybrid,
        actor=cast(ActorRole, hybrid.view("actor") if len(roles) > 1 else hybrid),
        critic=cast(CriticRole, hybrid.view("critic")) if use_critic else None,
        reward=cast(RewardRole, hybrid.view("reward") if "reward" in roles else starts[1][0]),
        groups=[group for group, _ in starts] + ([judges] if judges is not None else []),
        teacher=cast(
            "TeacherRole | None", hybrid.view("teacher") if "teacher" in roles else teachers
        ),
    )
    set_data_layouts(hybrid, [started.actor, started.critic])
    if started.teacher is not None:  # the teachers' layout, on the group that holds them
        set_data_layouts(teachers or hybrid, [started.teacher])
    return started


def with_backend(
    group: WorkerGroup, init: dict[str, Any], device: str
) -> tuple[WorkerGroup, dict[str, Any]]:
    """`group` and its init kwargs, with the process group's backend where its ranks
    form one (several ranks: nccl on GPUs, gloo on CPUs)."""
    if group.world_size > 1:
        init["backend"] = "nccl" if device == "cuda" else "gloo"
    return group, init


def start_judges(cfg: RayRLConfig, env: GroupEnv, pools: list[ResourcePool]) -> WorkerGroup | None:
    """The LLM judge's replicas on its own pool (`reward_model.enable_resource_pool`),
    started before the reward workers, which are given their addresses; None when the
    judge has no pool of its own (each reward worker serves one in its process)."""
    pool = next((p for p in pools if p.spec.name == JUDGE_POOL), None)
    if pool is None:
        return None
    from rayrl.workers.judge import JudgeWorker

    group, init = new_group({"judge": (JudgeWorker, {"config": cfg})}, pool, JUDGE_POOL, env)
    res = cfg.resources
    start_groups(
        [(group, init)],
        create_timeout_s=res.create_timeout_s,
        init_timeout_s=res.init_timeout_s,
        init_retries=res.init_retries,
    )
    return group


def set_data_layouts(group: WorkerGroup, roles: Sequence[TrainRole | TeacherRole | None]) -> None:
    """The group's data layouts (`rayrl.controller.layout`) from what each role's ranks
    report (`data_parts`: which part of the rows each rank takes, by layout name): ranks
    of a sequence-parallel group or a tensor-parallel replica share theirs."""
    for role in roles:
        if role is None:
            continue
        reports = role.data_parts()
        for name in reports[0]:
            group.data_layouts[name] = DataLayout(tuple(int(r[name]) for r in reports))


def new_group(
    roles: dict[str, tuple[type, dict[str, Any]]], pool: ResourcePool, name: str, env: GroupEnv
) -> tuple[WorkerGroup, dict[str, Any]]:
    """A group for `roles` (one class, or several fused) on `pool`, and its init
    kwargs (the process group's timeout among them); not started yet."""
    if len(roles) == 1:
        [(cls, init)] = roles.values()
    else:
        cls = colocate({role: c for role, (c, _) in roles.items()})
        init = {role: kwargs for role, (_, kwargs) in roles.items()}
    group = WorkerGroup(
        cls,
        pool.bundles,
        role=name,
        run=env.run,
        kv=env.kv,
        pool=pool,
        runtime_env={"env_vars": env.debug_env} if env.debug_env else None,
        usage_interval_s=env.usage_interval_s,
    )
    group.stage_timeout_s = env.stage_timeout_s
    return group, {**init, "pg_timeout_s": env.pg_timeout_s}


def group_env(
    cfg: RayRLConfig | SFTConfig, run: str, kv: KVStore, pg_timeout_s: float | None
) -> GroupEnv:
    """A run's `GroupEnv` from its config (`rayrl train`'s or `rayrl sft`'s)."""
    t = cfg.trainer
    return GroupEnv(
        run=run,
        kv=kv,
        debug_env=debug_env(cfg),
        usage_interval_s=getattr(t, "usage_interval_s", 0.5),
        stage_timeout_s=getattr(t, "stage_timeout_s", None) or None,
        pg_timeout_s=pg_timeout_s,
    )


def print_placement(
    groups: list[WorkerGroup], debug: bool, print_fn: Callable[[str], None]
) -> None:
    """Where each group runs (and, with `trainer.debug`, each group's debugger state)."""
    for group in groups:
        nodes = [str(info.get("node_id") or "?")[:8] for info in group.infos]
        roles = list(getattr(group.worker_cls, "ROLES", ()))
        holds = f" (roles {', '.join(roles)} in each)" if roles else ""
        print_fn(f"{group.role}: {group.world_size} worker(s){holds} on node(s) {', '.join(nodes)}")
    if debug:
        import ray

        for group in groups:
            state = ray.get(group.actors[0].debugger_state.remote())
            print_fn(
                f"Ray debugger in {group.role} rank 0: RAY_DEBUG={state['RAY_DEBUG']}, "
                f"post-mortem {'on' if state['post_mortem'] else 'off'}, breakpoint() -> "
                f"{state['breakpoint'] or state['breakpointhook']}"
            )
        print_fn(
            "breakpoint() in a worker method pauses it; an exception stops there for "
            "post-mortem. Attach as the README's 'Debugging workers' says."
        )
