"""Sequence-length balancing across data-parallel ranks (verl's `trainer.balance_batch`).

A group call splits a Batch into contiguous, equal-sized chunks, one per rank. After
generation the sequences' lengths are known and differ widely, so plain chunks leave
some ranks with far more tokens than others, and every rank waits for the slowest in
each collective. `balanced_order` permutes the rows so that each rank's chunk holds the
same number of rows and close to the same number of tokens: longest rows first, each
to the lightest rank that still has room (greedy LPT with equal counts). The order is
deterministic (ties go to the lower row and the lower rank), so a step replays exactly.

The generated samples are reordered where the driver assembles them from the ranks'
results (`balanced_samples`): each rank's rows are copied once, straight to their
balanced positions, instead of concatenated and then copied again in the new order.
"""

from __future__ import annotations

import heapq

import torch

from rayrl.batch import Batch
from rayrl.controller.dispatch import Outputs, kept_rows
from rayrl.workers.context import StageResult, collect_stage, slowest, summed

__all__ = [
    "balance_batch",
    "balanced_order",
    "balanced_samples",
    "imbalance",
    "sequence_lengths",
]


def balanced_order(lengths: list[int], parts: int) -> list[int]:
    """A permutation of ``range(len(lengths))`` whose ``parts`` contiguous equal chunks
    have close token sums; ``len(lengths)`` must be a multiple of ``parts``."""
    if parts < 1 or len(lengths) % parts:
        raise ValueError(
            f"{len(lengths)} rows do not split into {parts} equal parts; pad the batch to a "
            "multiple of the world size first"
        )
    room = len(lengths) // parts
    heap = [(0, p) for p in range(parts)]  # (tokens so far, part)
    chunks: list[list[int]] = [[] for _ in range(parts)]
    for row in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, part = heapq.heappop(heap)
        chunks[part].append(row)
        if len(chunks[part]) < room:
            heapq.heappush(heap, (load + lengths[row], part))
    return [row for chunk in chunks for row in sorted(chunk)]


def imbalance(lengths: list[int], order: list[int], parts: int) -> float:
    """Tokens of the heaviest chunk over the mean chunk (1.0 is perfect balance)."""
    size = len(order) // parts
    loads = [sum(lengths[i] for i in order[p * size : (p + 1) * size]) for p in range(parts)]
    mean = sum(loads) / parts
    return max(loads) / mean if mean else 1.0


def balance_batch(batch: Batch, parts: int) -> tuple[Batch, dict[str, float]]:
    """``batch`` reordered so each of ``parts`` rank chunks holds about the same number
    of real tokens (``attention_mask`` sums), with the imbalance before and after."""
    order, metrics = _order(sequence_lengths(batch).tolist(), parts)
    return (batch if order is None else batch.index(order)), metrics


def sequence_lengths(batch: Batch) -> torch.Tensor:
    """Each row's real tokens: its `sequence_length` column (generated samples carry
    one, `rayrl.workers.common.with_lengths`), else its attention mask's sum."""
    if "sequence_length" in batch:
        return batch["sequence_length"]
    return batch["attention_mask"].sum(-1)


def balanced_samples(done: Outputs, parts: int) -> tuple[StageResult, dict[str, float]]:
    """A generate call's `StageResult`s (`done`: as its ranks returned them, with the
    call's dispatch state) assembled into one, the padding dropped and the rows in
    `balanced_order` over ``parts`` ranks, in the one copy that assembling makes; with
    the imbalance before and after (as `balance_batch`)."""
    batches = [out.batch for out in done.outputs]
    rows = kept_rows(sum(len(b) for b in batches), done.state)
    lengths = torch.cat([sequence_lengths(b) for b in batches])[:rows].tolist()
    order, metrics = _order(lengths, parts)
    if order is None:
        return collect_stage(done.outputs, done.state), metrics
    result = StageResult(Batch.concat(batches, rows=order), slowest(done.outputs))
    result.counts = summed(done.outputs)
    return result, metrics


def _order(lengths: list[int], parts: int) -> tuple[list[int] | None, dict[str, float]]:
    """`balanced_order` of rows of ``lengths`` with the imbalance before and after;
    None (no reordering) for one part or rows that do not split evenly."""
    if parts <= 1 or len(lengths) % parts:
        return None, {}
    order = balanced_order(lengths, parts)
    metrics = {
        "perf/dp_imbalance_before": imbalance(lengths, list(range(len(lengths))), parts),
        "perf/dp_imbalance": imbalance(lengths, order, parts),
    }
    return order, metrics
