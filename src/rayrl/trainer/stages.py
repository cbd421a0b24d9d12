"""A training step as a list of stages, each holding its column contract.

A trainer builds its step as `Stage` values (`PPOTrainer.stages`) and runs them in
order on one `StepState`. Two kinds cover every stage:

- `GroupStage`: one call of a worker group on the step's samples. It holds what the
  call is sent (`reads`: the columns the method declares it reads, next to the
  method) and what comes back (`keep`: the result's columns joined into the samples,
  all when None; or, for an update, the metrics it returns). It is timed under its
  name (`timing_s/<name>`) and made through the step's `StageCalls`, so a replayed
  step reuses its kept result (`rayrl.trainer.replay`).
- `LocalStage`: work of the trainer's own process (scoring's shaping, dynamic
  sampling, advantages, the token check), a function of the state.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

from rayrl.batch import Batch
from rayrl.trainer.metrics import timer
from rayrl.trainer.step_state import StepState

__all__ = [
    "GroupStage",
    "LocalStage",
    "Stage",
    "only_reads",
    "run_stages",
    "update_stage",
]


class Stage(Protocol):
    """One stage of a step: its name (`timing_s/<name>`, replay's key) and its work."""

    @property
    def name(self) -> str: ...

    def run(self, state: StepState) -> None: ...


@dataclass(frozen=True)
class GroupStage:
    """A worker group's call on the step's samples (module docstring).

    `with_ctx`: the call takes the step's `StepContext` after its rows (the updates);
    `mutates`: it changes the group's state (replay runs it again after a restore);
    `returns_metrics`: its result is a dict of metrics, not rows; `after`: metrics of
    its result and the samples, computed once it returned; `when`: whether it runs
    this step (None: always).
    """

    name: str
    method: Any  # a group method (`rayrl.controller.method.GroupMethod`)
    reads: tuple[str, ...]
    keep: tuple[str, ...] | None = None
    with_ctx: bool = False
    mutates: bool = False
    returns_metrics: bool = False
    after: Callable[[Batch, Batch], dict[str, float]] | None = None
    when: Callable[[StepState], bool] | None = None

    def run(self, state: StepState) -> None:
        if self.when is not None and not self.when(state):
            return
        with timer(state.timing, self.name):
            samples = state.samples
            args = (only_reads(samples, self.reads),) + ((state.ctx,) if self.with_ctx else ())
            out = state.calls.run(self.name, self.method, *args, mutates=self.mutates)
            if self.returns_metrics:
                state.metrics.update(out)
                return
            kept = out if self.keep is None else out.select(*[k for k in self.keep if k in out])
            state.batch = samples.union(kept)
            if self.after is not None:
                state.metrics.update(self.after(out, state.batch))


@dataclass(frozen=True)
class LocalStage:
    """Work of the trainer's own process on the state; timed under `timed` when given
    (a stage that times its parts itself, or that takes no time worth a key, gives
    None)."""

    name: str
    work: Callable[[StepState], None]
    timed: str | None = None

    def run(self, state: StepState) -> None:
        with timer(state.timing, self.timed) if self.timed else nullcontext():
            self.work(state)


def update_stage(
    name: str, method: Any, reads: tuple[str, ...], when: Callable[[StepState], bool] | None = None
) -> GroupStage:
    """An update's stage: sent the step's context too, returning its metrics, changing
    its group's state."""
    return GroupStage(
        name, method, reads, with_ctx=True, mutates=True, returns_metrics=True, when=when
    )


def only_reads(batch: Batch, reads: tuple[str, ...]) -> Batch:
    """The Batch a stage call is sent: `batch`'s columns among `reads` (the columns the
    method declares it reads, next to itself), sharing their storage, meta as it is.
    A declared column the batch lacks is left out: the method reads it only when there."""
    return batch.select(*[key for key in reads if key in batch])


def run_stages(stages: list[Stage], state: StepState) -> StepState:
    """`stages` run in order on `state`; the state they leave."""
    for stage in stages:
        stage.run(state)
    return state
