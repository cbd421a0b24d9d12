"""What a training loss gives the engine and gets from it (`TrainEngine.train_step`).

**The loss contract.** ``loss_fn(outputs, micro_batch) -> (loss, metrics)`` returns this
micro-batch's *share* of the mini-batch loss: the sum of its terms divided by the count
of the whole mini-batch over all ranks. The engine hands those counts over in
``micro_batch.meta`` (``global_token_count``: real response tokens, ``global_seq_count``:
sequences with at least one, both over every micro-batch of the mini-batch and every
rank), so ``LossAggregation(mode, global_token_count=..., global_seq_count=...)`` from
`rayrl.algos.aggregation` is exactly right. The engine then calls ``backward()`` on each
share as it is and *sums* the gradients over micro-batches (no division by their
number); FSDP averages gradients over ranks, so the engine multiplies each share by the
number of ranks before ``backward()`` to turn that average into a sum. The loss_fn must
not scale by the number of micro-batches or ranks itself. The result: the same
gradient, to rounding, whatever the split into micro-batches and ranks. The reported
``loss`` metric is the mini-batch loss (shares summed over micro-batches and ranks).

The loss_fn's *metrics* are shares too (a token mean is a masked sum divided by
``global_token_count``): the engine sums them over micro-batches and ranks, so each is
its mini-batch value whatever the split, then averages over the mini-batches. A metric
given as a `Peak` is a maximum instead: the engine keeps the largest over micro-batches
and ranks (then averages those over the mini-batches, as the others).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from torch import Tensor

from rayrl.batch import Batch

__all__ = ["LossFn", "Peak"]

LossFn = Callable[[dict[str, Tensor], Batch], tuple[Tensor, dict[str, Any]]]


class Peak(NamedTuple):
    """A loss metric that is a maximum over micro-batches and ranks, not a share."""

    value: Tensor | float
