"""Teachers of on-policy distillation: frozen models that score the student's samples.

Each teacher is a frozen training engine (`rayrl.train.engine.TrainEngine`, no
optimizer) over its model, built as the reference is (`actor_rollout_ref.ref`'s
`fsdp_config`, sequence parallelism and log-prob micro-batches); why the training
engine and not a rollout engine: `rayrl.config.distill`. `compute_teacher_log_prob`
returns each response token's log-prob under its row's teacher (`teacher_log_prob`),
at the student's log-prob temperature.

The role lives in the actor's processes (`distillation.nnodes=0`) or on a pool of its
own. With several teachers, a row's `distillation.teacher_key` (a column, or an entry of
its `extra_info`) picks its teacher;
every rank runs every teacher's forward (FSDP's collectives need all ranks in step), on
one stand-in row where it has none of that teacher's rows.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
import torch

from rayrl.batch import Batch
from rayrl.config.distill import teachers
from rayrl.config.schema import RayRLConfig
from rayrl.controller import DP_SPLIT, ONE_TO_ALL, Worker, register
from rayrl.train.outputs import IMAGE_COLUMN, MODEL_INPUTS
from rayrl.workers.common import forward_sizes, logprob_temperature, reference_kwargs

if TYPE_CHECKING:
    from rayrl.train.engine import TrainEngine

__all__ = ["TeacherWorker", "teacher_picks", "teacher_reads"]


def teacher_reads(cfg: RayRLConfig) -> tuple[str, ...]:
    """The columns of the step's batch `compute_teacher_log_prob` reads: the model's
    inputs, the rows' images where prompts have them, and with several teachers what
    picks each row's teacher (`teacher_picks`)."""
    reads: tuple[str, ...] = (*MODEL_INPUTS, IMAGE_COLUMN)
    if len(teachers(cfg.distillation)) > 1:
        reads += (cfg.distillation.teacher_key, "extra_info")
    return reads


def teacher_picks(batch: Batch, key: str) -> list[str] | None:
    """Each row's value of `distillation.teacher_key`: a column of the batch
    (`data_source`), else an entry of the rows' `extra_info` (where a dataset's other
    fields travel, as in verl's data); None where neither has it."""
    if key in batch:
        return [str(value) for value in batch[key]]
    infos = batch.get("extra_info")
    if infos is None or not all(isinstance(i, dict) and key in i for i in infos):
        return None
    return [str(info[key]) for info in infos]


class TeacherWorker(Worker):
    """Teacher log-probs (`teacher_log_prob`) of sampled responses."""

    def init_worker(self, config: RayRLConfig) -> None:
        from rayrl.train.engine import TrainEngine  # in the worker only

        self.cfg = config
        arr = config.actor_rollout_ref
        # the teacher is its own model: the student's overrides and tokenizer are not its
        model = dataclasses.replace(arr.model, override_config={}, tokenizer_path=None)
        kwargs = reference_kwargs(
            model,
            arr.ref.fsdp_config,
            config.trainer.seed,
            arr.ref.use_torch_compile,
            arr.ref.ulysses_sequence_parallel_size,
        )
        self.engines: dict[str, TrainEngine] = {
            key: TrainEngine(teacher.model_path, trainable=False, join=self.joining, **kwargs)
            for key, teacher in sorted(teachers(config.distillation).items())
        }

    def rebuild(self) -> None:
        """The frozen weights sharded anew from the shards this rank holds."""
        for engine in self.engines.values():
            engine.rebuild()

    @register(dispatch=ONE_TO_ALL)
    def data_parts(self) -> dict[str, int]:
        """This rank's part of the `teacher` data layout (`controller.layout`)."""
        return {"teacher": next(iter(self.engines.values())).dp_rank}

    @register(dispatch=DP_SPLIT, layout="teacher")
    def compute_teacher_log_prob(self, batch: Batch) -> Batch:
        """Each response token's log-prob under its row's teacher."""
        if len(self.engines) == 1:
            [engine] = self.engines.values()
            return Batch({"teacher_log_prob": self._forward(engine, batch)})
        dist = self.cfg.distillation
        found = teacher_picks(batch, dist.teacher_key)
        if found is None:
            raise ValueError(
                f"teacher rank {self.rank}: rows without `{dist.teacher_key}` (a column or an "
                "extra_info entry), which picks each row's teacher: set "
                "distillation.teacher_key to one the data has (data_source, by default)"
            )
        picks = np.array(found, dtype=object)
        unknown = sorted({str(value) for value in picks} - set(self.engines))
        if unknown:
            raise ValueError(
                f"teacher rank {self.rank}: rows with {dist.teacher_key}={unknown[0]!r} have no "
                f"teacher (teachers' keys: {', '.join(sorted(self.engines))}); add a teacher "
                f"with that key under distillation.teacher_models, or fix the data's "
                f"{dist.teacher_key} column"
            )
        out = torch.zeros(batch["response_mask"].shape, dtype=torch.float32)
        for key, engine in self.engines.items():  # every rank, every teacher, same order
            rows = np.flatnonzero(picks == key)
            scored = self._forward(engine, batch.index(rows if len(rows) else [0]))
            if len(rows):
                out[torch.as_tensor(rows)] = scored
        return Batch({"teacher_log_prob": out})

    def _forward(self, engine: TrainEngine, batch: Batch) -> torch.Tensor:
        arr = self.cfg.actor_rollout_ref
        out = engine.forward(
            batch, temperature=logprob_temperature(arr.rollout), **forward_sizes(arr.ref)
        )
        return out["log_probs"]
