"""What one training step carries from stage to stage (`rayrl.trainer.stages`).

A step starts from its prompts; the generate stage puts the samples in `batch`, and
each later stage reads and extends it: columns joined (log-probs, values, scores,
advantages), metrics and timings added, the reward call in flight kept in `scores`
until the stage that needs them collects it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from rayrl.batch import Batch
from rayrl.trainer.stage_calls import StageCalls
from rayrl.workers.context import StepContext

__all__ = ["StepState"]


@dataclass
class StepState:
    """One step's prompts, samples, options, in-flight reward call, response lengths
    (taken before the advantage stage may mask tokens), metrics and timings."""

    prompts: Batch
    calls: StageCalls
    ctx: StepContext
    batch: Batch | None = None  # the samples, once generated
    scores: Any = None  # the reward call in flight (`StageCalls.start`), until collected
    lengths: torch.Tensor | None = None  # response tokens per row, before any masking
    metrics: dict[str, float] = field(default_factory=dict)
    timing: dict[str, float] = field(default_factory=dict)

    @classmethod
    def begin(cls, prompts: Batch, calls: StageCalls) -> StepState:
        """The state of a step about to run on `prompts` (their meta names the step)."""
        return cls(prompts, calls, StepContext(step=int(prompts.meta["step"])))

    @property
    def samples(self) -> Batch:
        """The step's samples; a stage that runs before generation has none."""
        if self.batch is None:
            raise RuntimeError("a stage read the step's samples before the generate stage ran")
        return self.batch
