"""What a role's call needs to know besides its rows, and what comes back besides them.

The trainer passes a `StepContext` to the stage calls that need options (generate and
the updates) as a broadcast argument (each rank gets the same value): which step the
rows belong to, how to sample, which extra stages the call computes on the same rows,
and whether an update computes the old log-probs itself. A worker never reads such options
from the Batch: `Batch.meta` only describes the data (its step, epoch and position).

A call that measures its own stages returns a `StageResult`: the rows, and the seconds
each stage took on the worker (`timing`), collected over ranks by `collect_stage`
(rows concatenated in rank order, padding dropped; the slowest rank's time per stage).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from rayrl.batch import Batch
from rayrl.controller.dispatch import collect_dp

# How a generate call samples: the training settings (`rollout.*`), validation's
# (`rollout.val_kwargs.*`), or one greedy response per prompt (ReMax's baseline).
SAMPLING_MODES = ("train", "validate", "greedy")


@dataclass(frozen=True)
class StepContext:
    """Options of one stage call (see the module docstring).

    Args:
        step: the global step the rows belong to (seeds sampling and shuffles).
        sampling: "train", "validate" or "greedy" (`SAMPLING_MODES`).
        with_scores: the generate call also scores its samples with the reward role
            running in its process (`rayrl.trainer.ride_along`).
        with_ref: the generate call also computes the reference log-probs.
        on_policy: the update computes the old log-probs itself (one epoch over one
            mini-batch: `rayrl.trainer.on_policy`); the batch has no `old_log_probs`.
    """

    step: int = 0
    sampling: str = "train"
    with_scores: bool = False
    with_ref: bool = False
    on_policy: bool = False

    def __post_init__(self) -> None:
        if self.sampling not in SAMPLING_MODES:
            raise ValueError(
                f"StepContext.sampling must be one of {SAMPLING_MODES}; got {self.sampling!r}"
            )

    def but(self, **changes: Any) -> StepContext:
        """A copy with `changes` (e.g. `ctx.but(sampling="greedy")`)."""
        return replace(self, **changes)


@dataclass
class StageResult:
    """A call's rows, the seconds its stages took on the worker by stage name, and
    counts of its work (``counts``: summed over ranks, e.g. the rollout's prompt
    tokens and those its prefix cache held)."""

    batch: Batch
    timing: dict[str, float] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=dict)


def collect_stage(outputs: list[StageResult], state: Any) -> StageResult:
    """Collect for DP_SPLIT methods returning `StageResult`: rows concatenated (the
    split's padding dropped), each stage's time the slowest rank's, counts summed."""
    batch = collect_dp([o.batch for o in outputs], state)
    return StageResult(batch, slowest(outputs), summed(outputs))


def summed(outputs: list[StageResult]) -> dict[str, float]:
    """Each count over ranks' results, added up."""
    counts: dict[str, float] = {}
    for out in outputs:
        for name, value in out.counts.items():
            counts[name] = counts.get(name, 0.0) + float(value)
    return counts


def slowest(outputs: list[StageResult]) -> dict[str, float]:
    """Each stage's time over ranks' results: the slowest rank's."""
    timing: dict[str, float] = {}
    for out in outputs:
        for stage, seconds in out.timing.items():
            timing[stage] = max(timing.get(stage, 0.0), float(seconds))
    return timing
