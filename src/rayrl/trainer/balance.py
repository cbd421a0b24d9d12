"""Sequence-length balancing across data-parallel ranks (verl's `trainer.balance_batch`).

A group call splits a Batch into contiguous, equal-sized chunks, one per rank. After
generation the sequences' lengths are known and differ widely, so plain chunks leave
some ranks with far more tokens than others, and every rank waits for the slowest in
each collective. `balanced_order` permutes the rows so that each rank's chunk holds the
same number of rows and close to the same number of tokens: longest rows first, each
to the lightest rank that still has room (greedy LPT with equal counts). The order is
deterministic (ties go to the lower row and the lower rank), so a step replays exactly.
"""

from __future__ import annotations

import heapq

from rayrl.batch import Batch

__all__ = ["balance_batch", "balanced_order", "imbalance"]


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
    lengths = batch["attention_mask"].sum(-1).tolist()
    if parts <= 1 or len(lengths) % parts:
        return batch, {}
    order = balanced_order(lengths, parts)
    metrics = {
        "perf/dp_imbalance_before": imbalance(lengths, list(range(len(lengths))), parts),
        "perf/dp_imbalance": imbalance(lengths, order, parts),
    }
    return batch.index(order), metrics
