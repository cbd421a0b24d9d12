"""Micro-batch planning and sequence packing, without a model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rayrl.train.packing import (
    pack_sequences,
    padded_response_index,
    plan_fixed,
    plan_token_budget,
    split_to_count,
)


def test_plan_fixed_chunks_in_order():
    assert plan_fixed(5, 2) == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="micro_batch_size"):
        plan_fixed(3, 0)


def test_token_budget_first_fit_decreasing():
    # 9+1 | 8+2 | 7+3 fills three bins of 10 exactly.
    bins = plan_token_budget([9, 8, 7, 3, 2, 1], 10)
    assert sorted(map(sorted, bins)) == [[0, 5], [1, 4], [2, 3]]


def test_token_budget_names_the_row_too_long():
    with pytest.raises(ValueError, match=r"row 1 has 12 real tokens.*at least 12"):
        plan_token_budget([3, 12, 4], 10)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=25),
    budget=st.integers(30, 80),
    extra=st.integers(0, 6),
)
def test_budget_bins_cover_rows_once_and_split_keeps_budget(lengths, budget, extra):
    bins = plan_token_budget(lengths, budget)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= budget for b in bins)
    split = split_to_count(bins, lengths, len(bins) + extra)
    assert sorted(i for b in split for i in b) == list(range(len(lengths)))
    assert len(split) == min(len(bins) + extra, len(lengths))
    assert all(sum(lengths[i] for i in b) <= budget for b in split)


def _two_rows():
    # width 6, response 3: row 0 = [pad, p1, p2 | r1, r2, pad]; row 1 = [p1, p2, p3 | r1, pad, pad]
    ids = torch.tensor([[0, 11, 12, 13, 14, 0], [21, 22, 23, 24, 0, 0]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def test_pack_sequences_concatenates_real_tokens_with_restarting_positions():
    ids, mask, pos = _two_rows()
    packed = pack_sequences(ids, mask, pos, response_len=3)
    assert packed.input_ids.tolist() == [[11, 12, 13, 14, 21, 22, 23, 24]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    r = packed.response
    assert r.valid.tolist() == [[True, True, False], [True, False, False]]
    # token 13 is predicted at packed position 1 (token 12), 14 at 2, 24 at 6 (token 23)
    assert r.logit_index.tolist() == [1, 2, 6]
    assert r.labels.tolist() == [13, 14, 24]
    assert r.scatter(torch.tensor([1.0, 2.0, 3.0])).tolist() == [[1, 2, 0], [3, 0, 0]]


def test_padded_index_reads_the_column_before_each_response_token():
    ids, mask, _ = _two_rows()
    index = padded_response_index(ids, mask, response_len=3)
    assert index.logit_index.tolist() == [2, 3, 4]
    assert index.labels.tolist() == [[13, 14, 0], [24, 0, 0]]
    with pytest.raises(ValueError, match="at least one prompt column"):
        padded_response_index(ids, mask, response_len=6)


def test_packing_rejects_holes_and_offset_positions():
    ids, mask, pos = _two_rows()
    holed = mask.clone()
    holed[1, 1] = 0
    with pytest.raises(ValueError, match="row 1: attention_mask has padding between"):
        pack_sequences(ids, holed, pos, response_len=3)
    with pytest.raises(ValueError, match="row 0: position_ids start at 5"):
        pack_sequences(ids, mask, pos + 5, response_len=3)


def test_packing_pays_on_a_gpu_with_any_padding_on_a_cpu_from_a_quarter():
    from rayrl.train.packing import worth_packing

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    mask = torch.ones(4, 10, dtype=torch.long)
    assert not worth_packing(mask, cpu) and not worth_packing(mask, cuda)  # no padding
    mask[0, 0] = 0  # 2.5% padding
    assert not worth_packing(mask, cpu) and worth_packing(mask, cuda)
    mask[:, :3] = 0  # 30%
    assert worth_packing(mask, cpu) and worth_packing(mask, cuda)


def test_a_shared_budget_keeps_a_prompts_rows_together_counting_each_row_whole():
    from rayrl.train.packing import plan_shared_budget

    # two prompts of 10 tokens, four rows each of 10 + 5 tokens; interleaved rows
    groups = [([0, 2, 4, 6], 10), ([1, 3, 5, 7], 10)]
    lengths = [15] * 8
    assert plan_shared_budget(lengths, groups, 120) == [list(range(8))]
    # in 60, one prompt per micro-batch (plain FFD would mix them: [0..3], [4..7])
    assert plan_token_budget(lengths, 60) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert plan_shared_budget(lengths, groups, 60) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # in 30, a prompt's rows are split into chunks of 2 rows
    assert plan_shared_budget(lengths, groups, 30) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    with pytest.raises(ValueError, match="row 0 has 15 real tokens"):
        plan_shared_budget(lengths, groups, 14)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 12)), min_size=1, max_size=8),
    responses=st.lists(st.integers(0, 20), min_size=48, max_size=48),
    budget=st.integers(33, 90),
)
def test_shared_budget_bins_cover_rows_once_within_budget(sizes, responses, budget):
    from rayrl.train.packing import plan_shared_budget

    groups, lengths, k = [], [], 0
    for count, prompt in sizes:
        rows = list(range(len(lengths), len(lengths) + count))
        lengths += [prompt + responses[k + i] for i in range(count)]
        k += count
        groups.append((rows, prompt))
    bins = plan_shared_budget(lengths, groups, budget)
    assert sorted(r for b in bins for r in b) == list(range(len(lengths)))
    assert all(sum(lengths[r] for r in b) <= budget for b in bins)
    # a prompt's rows are split only when they exceed the budget together
    for rows, _ in groups:
        holding = [b for b in bins if set(rows) & set(b)]
        if sum(lengths[r] for r in rows) <= budget:
            assert len(holding) == 1
