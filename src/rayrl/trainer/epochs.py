"""Walking a dataset epoch by epoch from a data position, as checkpoints record it.

A run's data position is (epoch, batch index) of the next step (`Progress`).
`epoch_batches` yields the batches from there to the end of the run, each epoch in
its own seeded order; `Progress.advance` moves the position past a batch's step;
a run resumed from a checkpoint therefore sees exactly the batches it would have seen.
`total_steps` is a run's length: `trainer.total_training_steps`, or whole batches x epochs.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from rayrl.batch import Batch
from rayrl.config.schema import TrainerConfig
from rayrl.config.sft import SFTTrainerConfig
from rayrl.trainer.state import Progress


def total_steps(trainer_cfg: TrainerConfig | SFTTrainerConfig, rows: int, batch_size: int) -> int:
    """`trainer.total_training_steps`, or the whole batches of `rows` x `total_epochs`."""
    if trainer_cfg.total_training_steps is not None:
        return trainer_cfg.total_training_steps
    return max(1, rows // batch_size) * trainer_cfg.total_epochs


def epoch_batches(
    dataset: Any,
    batch_size: int,
    *,
    start: Progress,
    total: int,
    epochs: int | None,
    seed: int,
    shuffle: bool,
) -> Iterator[tuple[int, Batch]]:
    """(step, batch) from `start` until `total` steps (or `epochs` epochs, when given).
    Each batch's meta carries `step`, `epoch` and `batch_index` (its index in the epoch)."""
    step, epoch, first = start.global_step, start.epoch, start.batch
    while step < total and (epochs is None or epoch < epochs):
        batches = dataset.batches(batch_size, epoch=epoch, seed=seed, shuffle=shuffle, start=first)
        for index, batch in enumerate(batches, start=first):
            if step >= total:
                return
            batch.meta.update(step=step, epoch=epoch, batch_index=index)
            yield step, batch
            step += 1
        epoch, first = epoch + 1, 0
