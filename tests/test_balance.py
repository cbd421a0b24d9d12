"""Sequence-length balancing across ranks: equal row counts, close token sums, deterministic."""

from __future__ import annotations

import random

import pytest
import torch

from rayrl.batch import Batch
from rayrl.controller.dispatch import DPState, Outputs
from rayrl.trainer.balance import balance_batch, balanced_order, balanced_samples, imbalance
from rayrl.workers.context import StageResult, collect_stage


def test_order_is_a_permutation_with_equal_chunks_and_balanced_tokens():
    rng = random.Random(0)
    lengths = [rng.randint(10, 1000) for _ in range(64)]
    order = balanced_order(lengths, 4)
    assert sorted(order) == list(range(64))
    before = imbalance(lengths, list(range(64)), 4)
    after = imbalance(lengths, order, 4)
    assert after < before and after < 1.02, (before, after)
    assert balanced_order(lengths, 4) == order  # deterministic


def test_sorted_lengths_are_the_worst_case_for_plain_chunks():
    lengths = list(range(1, 17))  # contiguous chunks: 10, 26, 42, 58 tokens
    order = balanced_order(lengths, 4)
    loads = [sum(lengths[i] for i in order[p * 4 : (p + 1) * 4]) for p in range(4)]
    assert loads == [34, 34, 34, 34]


def test_rows_must_split_evenly():
    with pytest.raises(ValueError, match="equal parts"):
        balanced_order([1, 2, 3], 2)


def test_balance_batch_reorders_every_column_together():
    mask = torch.zeros(8, 10, dtype=torch.long)
    for row, n in enumerate([10, 9, 8, 7, 2, 2, 1, 1]):
        mask[row, :n] = 1
    batch = Batch(
        {"attention_mask": mask, "row": torch.arange(8)}, {"uid": [f"u{i}" for i in range(8)]}
    )
    out, metrics = balance_batch(batch, 2)
    assert [f"u{int(r)}" for r in out["row"]] == list(out["uid"])
    assert metrics["perf/dp_imbalance"] < metrics["perf/dp_imbalance_before"]
    same, none = balance_batch(batch, 1)
    assert same is batch and none == {}


def test_generated_samples_are_balanced_as_they_are_assembled():
    """Three ranks' results of a padded DP_SPLIT call (7 prompts padded to 9, 2 samples
    each): assembled and balanced in one copy, the same as collecting, then balancing."""
    rng = random.Random(1)
    outputs = []
    for rank in range(3):
        mask = torch.zeros(6, 12, dtype=torch.long)
        for row in range(6):
            mask[row, : rng.randint(1, 12)] = 1
        rows = torch.arange(6) + 6 * rank
        batch = Batch({"attention_mask": mask, "row": rows}, {"uid": [f"u{int(r)}" for r in rows]})
        outputs.append(StageResult(batch, {"gen": float(rank)}))
    done = Outputs(outputs, DPState(pad=2, padded_len=9))
    for parts in (1, 3, 2):  # 14 rows: 3 parts do not split them, nothing moves
        result, metrics = balanced_samples(done, parts)
        expected, found = balance_batch(collect_stage(outputs, done.state).batch, parts)
        assert result.batch.equals(expected) and metrics == found
        assert result.timing == {"gen": 2.0} and len(result.batch) == 14
    assert metrics["perf/dp_imbalance"] <= metrics["perf/dp_imbalance_before"]
