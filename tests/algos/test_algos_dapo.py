"""DAPO pieces: overlong penalty, truncation detection and masking, group filtering."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from algos_testlib import FAST, cases
from hypothesis import given
from hypothesis import strategies as st

from rayrl.algos import filter_groups, find_truncated, mask_truncated, overlong_penalty


def ref_overlong(length: int, max_len: int, buffer: int, factor: float) -> float:
    if length <= max_len - buffer:
        return 0.0
    if length <= max_len:
        return ((max_len - buffer) - length) / buffer * factor
    return -factor


@FAST
@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=10),
    max_len=st.integers(8, 32),
    buffer_frac=st.floats(0.1, 1.0),
    factor=st.sampled_from([1.0, 0.5]),
)
def test_overlong_penalty_matches_piecewise_reference(lengths, max_len, buffer_frac, factor):
    buffer = max(1, int(max_len * buffer_frac))
    got = overlong_penalty(torch.tensor(lengths), max_len, buffer, factor)
    for value, length in zip(got.tolist(), lengths, strict=True):
        assert value == pytest.approx(ref_overlong(length, max_len, buffer, factor), abs=1e-6)


def test_overlong_penalty_ramps_linearly():
    got = overlong_penalty(torch.tensor([10, 12, 14, 16, 20]), 16, 4, penalty_factor=1.0)
    assert got.tolist() == [0.0, 0.0, -0.5, -1.0, -1.0]
    with pytest.raises(ValueError, match="buffer_length"):
        overlong_penalty(torch.tensor([1]), 16, 0)


def test_find_truncated_uses_the_last_real_token():
    eos = 2
    ids = torch.tensor([[5, 6, 2, 0], [5, 6, 7, 8], [2, 0, 0, 0], [9, 9, 9, 9], [1, 1, 1, 1]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    assert find_truncated(ids, mask, eos).tolist() == [False, True, False, True, True]
    assert find_truncated(ids, mask, [1, 2]).tolist() == [False, True, False, True, False]


@FAST
@given(case=cases())
def test_mask_truncated_clears_exactly_the_truncated_rows(case):
    truncated = torch.rand(case.batch, generator=case.gen) < 0.5
    masked = mask_truncated(case.mask, truncated)
    assert masked.dtype == case.mask.dtype
    for i in range(case.batch):
        expected = torch.zeros_like(case.mask[i]) if truncated[i] else case.mask[i]
        assert torch.equal(masked[i], expected)


@FAST
@given(
    groups=st.lists(st.integers(0, 5), min_size=1, max_size=16),
    values=st.data(),
)
def test_filter_groups_matches_loop_reference(groups, values):
    metric = values.draw(
        st.lists(st.sampled_from([0.0, 1.0]), min_size=len(groups), max_size=len(groups))
    )
    index = np.array([f"p{g}" for g in groups], dtype=object)
    result = filter_groups(index, torch.tensor(metric))
    members: dict[str, list[float]] = {}
    for uid, m in zip(index, metric, strict=True):
        members.setdefault(uid, []).append(m)
    kept = {uid for uid, ms in members.items() if len(ms) == 1 or len(set(ms)) > 1}
    assert result.keep.tolist() == [uid in kept for uid in index]
    assert result.num_kept_groups == len(kept)
    assert result.num_groups == len(members)


def test_filter_groups_tolerance_and_integer_index():
    metric = torch.tensor([0.5, 0.5 + 1e-9, 1.0, 0.0, 3.0])
    result = filter_groups(torch.tensor([7, 7, 8, 8, 9]), metric, tolerance=1e-6)
    assert result.keep.tolist() == [False, False, True, True, True]
    assert (result.num_kept_groups, result.num_groups) == (2, 3)
