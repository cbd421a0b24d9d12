"""The checks of the profiler's keys at load (`check_profiler`, called by
`rayrl.config.validate`): `global_profiler.*` and each role's `profiler` group
(`rayrl.config.profiler`).

rayrl takes torch.profiler traces only. verl's other tools (Nsight Systems, Ascend's
NPU profiler, CUDA memory snapshots, the precision debugger) take no traces: the run
goes on without them and a warning says what to use instead (a script written for an
NPU still trains). A trace that spans several steps is refused. A tool without
`global_profiler.steps` profiles nothing, as in verl (whose example scripts set one so):
it is said in a warning.
"""

from __future__ import annotations

from collections.abc import Callable

from rayrl.config.errors import ConfigError
from rayrl.config.profiler import (
    PROFILED_ROLES,
    TORCH_CONTENTS,
    VERL_ROLE_GROUPS,
    ProfilerConfig,
)
from rayrl.config.schema import RayRLConfig

__all__ = ["check_profiler"]

KEY = "global_profiler"
OTHER_TOOLS = {
    "nsys": "Nsight Systems",
    "npu": "Ascend's NPU profiler",
    "torch_memory": "CUDA memory snapshots",
    "precision_debugger": "the precision debugger",
}


def check_profiler(cfg: RayRLConfig, warn: Callable[[str], None]) -> None:
    prof: ProfilerConfig = cfg.global_profiler
    if prof.tool is None:
        return
    if not prof.steps:
        warn(
            f"{KEY}.tool={prof.tool} has no effect: {KEY}.steps is not set; give the step "
            f"numbers to trace with {KEY}.tool=torch, e.g. {KEY}.steps=[2,3]"
        )
        return
    if prof.tool in OTHER_TOOLS:
        warn(
            f"{KEY}.tool={prof.tool}: rayrl does not run {OTHER_TOOLS[prof.tool]}, so "
            f"steps {list(prof.steps)} are not traced; set {KEY}.tool=torch for "
            "torch.profiler traces (CPU and CUDA activity, open in Perfetto), or run the "
            "whole command under nsys yourself"
        )
        return
    if prof.tool != "torch":
        raise ConfigError(f"{KEY}.tool={prof.tool!r} is not a profiler: use torch, or null (off)")
    steps = prof.steps
    if not isinstance(steps, list) or not all(
        isinstance(s, int) and not isinstance(s, bool) for s in steps
    ):
        raise ConfigError(
            f"{KEY}.steps={steps!r} must be a list of the step numbers to trace (1 is the "
            f"first step), e.g. {KEY}.steps=[2,3]"
        )
    if min(steps) < 1:
        raise ConfigError(f"{KEY}.steps={list(steps)}: steps count from 1 (the first step)")
    if prof.profile_continuous_steps:
        raise ConfigError(
            f"{KEY}.profile_continuous_steps=true: rayrl writes each chosen step's traces "
            "in a directory of their own and has no trace across steps; set it to false"
        )
    for role in PROFILED_ROLES:
        _check_role(prof, role)


def _check_role(prof: ProfilerConfig, role: str) -> None:
    cfg = getattr(prof, role)
    where = f"{KEY}.{role} (verl's {VERL_ROLE_GROUPS[role]})"
    if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in cfg.ranks):
        raise ConfigError(f"{where}.ranks={list(cfg.ranks)} must be ranks (integers >= 0)")
    unknown = [c for c in cfg.tool_config.torch.contents if c not in TORCH_CONTENTS]
    if unknown:
        raise ConfigError(
            f"{where}.tool_config.torch.contents has {unknown}: choose from {list(TORCH_CONTENTS)}"
        )
