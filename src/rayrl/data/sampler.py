"""A sampler class of one's own: the order of the training rows (verl's `data.sampler`).

``data.sampler.class_path`` (a Python file, or ``pkg://module``) and ``class_name``
name a class that verl's other versions build as ``cls(data_source=dataset,
data_config=config.data)`` and iterate for each epoch's row indices (a
`torch.utils.data.Sampler`); a curriculum sampler also has ``update(batch)``, called
after every training step with that step's batch. rayrl does the same, keeping its
runs replayable:

- each epoch's order is the sampler's iteration, read once at the start of the epoch,
  with torch's random generator seeded from (seed, epoch) meanwhile (and restored
  after), so that a sampler drawing from torch's default generator (an unseeded
  `RandomSampler`) gives the same order again on a resume or a replay;
- ``update(batch)`` is called once per step, after the step's advantages, with a view of
  the step's batch in verl's shape (``batch.batch``: the tensors, ``non_tensor_batch``,
  ``meta_info``); a step replayed after a worker loss does not call it again. It changes
  the order of the following epochs (the current one was read at its start). A
  sampler's own state is not saved in checkpoints: after a resume it starts afresh.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from rayrl.data.errors import DataError

__all__ = ["StepView", "build_sampler", "sampler_order"]


@dataclass(frozen=True)
class StepView:
    """A step's batch as verl's curriculum samplers read it (a DataProto's fields)."""

    batch: dict[str, torch.Tensor]
    non_tensor_batch: dict[str, Any]
    meta_info: dict[str, Any]


def build_sampler(class_path: str, class_name: str, dataset: Any, data_config: Any) -> Any:
    """The sampler ``class_name`` of ``class_path`` built on ``dataset`` as verl builds it.

    Raises:
        DataError: the class cannot be loaded or built, or it cannot be iterated.
    """
    from rayrl.usercode import load_object

    where = f"data.sampler {class_path}:{class_name}"
    spec = f"{class_path.removeprefix('pkg://')}:{class_name}"
    try:
        cls = load_object(spec if class_path.startswith("pkg://") else (class_path, class_name))
        sampler = cls(data_source=dataset, data_config=data_config)
    except Exception as err:
        raise DataError(f"{where}: could not be built ({type(err).__name__}: {err})") from err
    if not hasattr(sampler, "__iter__"):
        raise DataError(f"{where}: {type(sampler).__name__} cannot be iterated for row indices")
    return sampler


def sampler_order(sampler: Any, rows: int, seed: int, epoch: int) -> list[int]:
    """One epoch's row indices from ``sampler``, torch's generator seeded from (seed, epoch)."""
    digest = hashlib.blake2b(f"{seed}:sampler:{epoch}".encode(), digest_size=8).digest()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int.from_bytes(digest, "little") >> 1)
        order = [int(i) for i in sampler]
    bad = [i for i in order if not 0 <= i < rows]
    if bad:
        raise DataError(
            f"data.sampler {type(sampler).__name__}: row indices {bad[:3]} are outside the "
            f"{rows} training rows"
        )
    return order
