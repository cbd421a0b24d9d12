"""Profiles a user can take: torch.profiler traces of chosen steps and roles, written
into the run directory with the step's stage timeline.

    rayrl train global_profiler.tool=torch global_profiler.steps=[2,3]

Each chosen step N (1 is the first step, as `training/global_step` counts) gets
``<save_path or RUN_DIR/profiles>/step_N/`` holding

- ``{role}_rank{r}.json.gz``: a Chrome trace of that role's calls in the step on that
  rank (``{role}_rank{r}.{call}.json.gz``, one per call, with the role's
  `tool_config.torch.discrete`), for the roles and ranks `global_profiler.<role>`
  chooses (verl's per-role `profiler` groups: `enable`, `ranks`, `all_ranks`);
- ``timeline.json``: the controller's stages of the step (the `timing_s/*` spans) as a
  Chrome trace, with the step's `timing_s/*` figures and the trace files in its
  ``otherData``.

Every file keeps torch's clock convention: ``baseTimeNanoseconds`` / 1000 + ``ts`` is
the wall clock in microseconds, so the files of one step line up. The roles are
verl's: rollout (`generate`), actor (`compute_log_prob`, `update_actor`), ref
(`compute_ref_log_prob`), critic (`compute_values`, `update_critic`); the calls run
under the profiler in the workers (`rayrl.controller.tracing`). A step that is replayed
after a worker failure writes its directory again.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rayrl.config.profiler import PROFILED_ROLES, ProfilerConfig
from rayrl.controller import WorkerGroup
from rayrl.controller.tracing import TraceTarget, TraceWindow
from rayrl.trainer.metrics import recording_spans

__all__ = ["CALL_ROLES", "StepProfiler"]

log = logging.getLogger("rayrl.trainer")

# the worker calls of each verl role a profile is filed under
CALL_ROLES = {
    "generate": "rollout",
    "compute_log_prob": "actor",
    "update_actor": "actor",
    "compute_ref_log_prob": "ref",
    "compute_values": "critic",
    "update_critic": "critic",
}
ARM_TIMEOUT_S = 60.0


class StepProfiler:
    """Traces the chosen steps of a run (module docstring); `cfg` None or with no tool:
    off, and `step` costs nothing."""

    def __init__(
        self, cfg: ProfilerConfig | None, run_root: Path, print_fn: Callable[[str], None]
    ) -> None:
        on = cfg is not None and cfg.tool == "torch"
        self.steps = {int(s) for s in (cfg.steps or [])} if cfg is not None and on else set()
        self.targets = _targets(cfg) if cfg is not None and on else {}
        save = cfg.save_path if cfg is not None else None
        self.root = Path(save).expanduser().resolve() if save else run_root / "profiles"
        self.print = print_fn

    def describe(self, total_steps: int) -> str | None:
        """What the run will profile (None when nothing), said once at the start."""
        if not self.steps:
            return None
        roles = sorted({t.label for t in self.targets.values()}, key=PROFILED_ROLES.index)
        late = sorted(s for s in self.steps if s > total_steps)
        beyond = f"; steps {late} are past the run's {total_steps} and not traced" if late else ""
        return (
            f"profiling steps {sorted(self.steps)} (roles {', '.join(roles)}) with "
            f"torch.profiler into {self.root}/step_N{beyond}"
        )

    @contextmanager
    def step(self, number: int, groups: list[WorkerGroup]) -> Iterator[dict[str, Any]]:
        """Trace step `number` when it is chosen; yields a dict for the step's metrics
        (its `timing_s/*` go into the timeline)."""
        metrics: dict[str, Any] = {}
        if number not in self.steps:
            yield metrics
            return
        directory = self.root / f"step_{number}"
        shutil.rmtree(directory, ignore_errors=True)  # a replayed or resumed step
        directory.mkdir(parents=True)
        actors = [a for g in groups for a in list(g.actors) if a is not None]
        window = TraceWindow(str(directory), self.targets)
        _each(actors, window)
        with recording_spans() as spans:
            try:
                yield metrics
            finally:
                files = [f for done in _each(actors, None) for f in done]
                timing = {k: v for k, v in metrics.items() if k.startswith("timing_s/")}
                write_timeline(directory / "timeline.json", number, spans, timing, files)
        self.print(f"step {number}: {len(files)} traces and timeline.json in {directory}")


def _targets(cfg: ProfilerConfig) -> dict[str, TraceTarget]:
    chosen = cfg.traced_roles()
    targets = {}
    for call, role in CALL_ROLES.items():
        if role in chosen:
            torch_cfg = getattr(cfg, role).tool_config.torch
            targets[call] = TraceTarget(
                label=role,
                ranks=cfg.traced_ranks(role),
                contents=tuple(torch_cfg.contents),
                discrete=bool(torch_cfg.discrete),
            )
    return targets


def _each(actors: list[Any], window: TraceWindow | None) -> list[list[str]]:
    """Arm (or, with None, disarm) `window` in every worker; a worker that does not
    answer (lost in the step: the replay replaces it) is left out, with a log line."""
    import ray

    refs = [a._rayrl_trace.remote(window) for a in actors]
    out = []
    for ref in refs:
        try:
            out.append(ray.get(ref, timeout=ARM_TIMEOUT_S))
        except Exception as err:  # noqa: BLE001 - a lost worker has no traces to give
            log.warning("a worker did not take the profiler's window: %s", err)
            out.append([])
    return out


def write_timeline(
    path: Path,
    number: int,
    spans: list[tuple[str, float, float]],
    timing: dict[str, float],
    files: list[str],
) -> None:
    """The step's stages as a Chrome trace (one track, the controller's), on torch's
    clock convention, with the step's figures in `otherData`."""
    base = min((start for _, start, _ in spans), default=0.0)
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "controller"}},
    ]
    for name, start, end in sorted(spans, key=lambda s: s[1]):
        events.append(
            {
                "name": name,
                "cat": "stage",
                "ph": "X",
                "pid": 0,
                "tid": 0,
                "ts": (start - base) * 1e6,
                "dur": (end - start) * 1e6,
            }
        )
    trace = {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "baseTimeNanoseconds": int(base * 1e9),
        "otherData": {
            "step": number,
            "timing_s": timing,
            "traces": [str(Path(f).relative_to(path.parent)) for f in files],
        },
    }
    path.write_text(json.dumps(trace, indent=1))
