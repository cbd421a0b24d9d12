"""The profiler's config group: verl 0.9.1's `global_profiler` keys, with each role's
`profiler` group (verl's `actor_rollout_ref.actor.profiler`, `.rollout.profiler`,
`.ref.profiler`, `critic.profiler`) moved under it as `global_profiler.<role>`
(`rayrl.config.compat.verl_ppo`), so one group says what a run profiles.

`global_profiler.tool=torch` with `global_profiler.steps=[2, 3]` writes torch.profiler
traces of those steps into the run directory (`rayrl.trainer.profiling`); the checks
at load are `rayrl.config.profiler_checks`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "PROFILED_ROLES",
    "TORCH_CONTENTS",
    "VERL_ROLE_GROUPS",
    "ProfilerConfig",
    "RoleProfilerConfig",
]

# verl's roles that have a `profiler` group, in the order a step reaches them
PROFILED_ROLES = ("rollout", "actor", "ref", "critic")
# where verl keeps each role's group (moved to `global_profiler.<role>`)
VERL_ROLE_GROUPS = {
    "rollout": "actor_rollout_ref.rollout.profiler",
    "actor": "actor_rollout_ref.actor.profiler",
    "ref": "actor_rollout_ref.ref.profiler",
    "critic": "critic.profiler",
}

# what `tool_config.torch.contents` may ask for (verl's names); empty: cpu and cuda
TORCH_CONTENTS = ("cpu", "cuda", "memory", "shapes", "stack")


@dataclass
class TorchToolConfig:
    contents: list[Any] = field(
        default_factory=list
    )  # cpu, cuda, memory, shapes, stack; []: cpu+cuda
    # true: a trace per call (rollout_rank0.generate.json.gz); false: one per role and
    # rank for the step, the role's calls side by side
    discrete: bool = False


@dataclass
class RoleToolConfig:
    torch: TorchToolConfig = field(default_factory=TorchToolConfig)


@dataclass
class RoleProfilerConfig:
    """Which ranks of one role are traced (verl's per-role `profiler` group)."""

    enable: bool = False  # no role enabled: every role is traced
    all_ranks: bool = False  # every rank of the role (else `ranks`)
    ranks: list[Any] = field(default_factory=list)  # []: rank 0, unless all_ranks
    tool_config: RoleToolConfig = field(default_factory=RoleToolConfig)


@dataclass
class ProfilerConfig:
    """verl's `global_profiler` group: the tool and the steps, for every role."""

    tool: str | None = None  # torch, or None (off); verl's nsys / npu / torch_memory: refused
    steps: list[Any] | None = None  # the step numbers traced (1 is the first step)
    profile_continuous_steps: bool = False  # one trace across consecutive steps: refused
    save_path: str | None = None  # None: the run directory's profiles/
    rollout: RoleProfilerConfig = field(default_factory=RoleProfilerConfig)
    actor: RoleProfilerConfig = field(default_factory=RoleProfilerConfig)
    ref: RoleProfilerConfig = field(default_factory=RoleProfilerConfig)
    critic: RoleProfilerConfig = field(default_factory=RoleProfilerConfig)

    def traced_roles(self) -> tuple[str, ...]:
        """The roles traced: those enabled, or every role when none is."""
        enabled = tuple(r for r in PROFILED_ROLES if getattr(self, r).enable)
        return enabled or PROFILED_ROLES

    def traced_ranks(self, role: str) -> tuple[int, ...] | None:
        """The ranks of `role` traced (None: every rank)."""
        cfg: RoleProfilerConfig = getattr(self, role)
        if cfg.all_ranks:
            return None
        return tuple(int(r) for r in cfg.ranks) or (0,)
