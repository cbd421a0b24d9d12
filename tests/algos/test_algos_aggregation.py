"""Loss aggregation modes, and invariance of loss and gradient to micro-batch/rank splits."""

from __future__ import annotations

import pytest
import torch
from algos_testlib import AGG_MODE_NAMES, FAST, Case, assert_close, cases, loop_aggregate
from hypothesis import given
from hypothesis import strategies as st

from rayrl.algos import (
    LossAggregation,
    aggregate_loss,
    kl_loss,
    ppo_policy_loss,
    token_and_seq_counts,
    value_loss,
)
from rayrl.algos.losses import gspo_policy_loss, reinforce_policy_loss


@FAST
@given(case=cases(holes=True), mode=st.sampled_from(AGG_MODE_NAMES))
def test_modes_match_loop_reference_with_garbage_in_padding(case, mode):
    loss_mat = case.randn()
    garbage = torch.where(case.mask.bool(), loss_mat, torch.tensor(float("nan")))
    got = aggregate_loss(garbage, case.mask, mode, norm_length=7.0)
    assert_close(got, torch.as_tensor(loop_aggregate(loss_mat, case.mask, mode, 7.0)))


def test_empty_mask_gives_zero_not_nan():
    for mode in AGG_MODE_NAMES:
        assert float(aggregate_loss(torch.ones(2, 3), torch.zeros(2, 3), mode)) == 0.0


def test_errors_name_the_fix():
    with pytest.raises(LookupError, match="Did you mean 'token-mean'.*loss_agg_mode"):
        LossAggregation("token_mean")
    with pytest.raises(ValueError, match="same .batch, response_len. shape"):
        aggregate_loss(torch.ones(2, 3), torch.ones(2, 4))


# ---------------------------------------------------------------- split invariance

LOSSES = {
    "ppo": lambda t, agg: ppo_policy_loss(t["lp"], t["old"], t["adv"], t["mask"], agg=agg)[0],
    "gspo": lambda t, agg: gspo_policy_loss(t["lp"], t["old"], t["adv"], t["mask"], agg=agg)[0],
    "reinforce": lambda t, agg: reinforce_policy_loss(
        t["lp"], t["old"], t["adv"], t["mask"], agg=agg
    )[0],
    "value": lambda t, agg: value_loss(t["lp"], t["old"], t["adv"], t["mask"], agg=agg)[0],
    "kl": lambda t, agg: kl_loss(t["lp"], t["old"], t["mask"], estimator="k3", agg=agg)[0],
}


def micro_batch(tensors: dict, rows: slice) -> dict:
    """Rows of the batch, re-padded to their own longest response (dynamic padding)."""
    mask = tensors["mask"][rows]
    real = mask.sum(dim=0).nonzero()
    width = int(real.max()) + 1 if real.numel() else 1
    return {k: v[rows, :width] for k, v in tensors.items()}


def split_rows(batch: int, cuts: list[int]) -> list[slice]:
    edges = [0, *sorted({c for c in cuts if 0 < c < batch}), batch]
    return [slice(a, b) for a, b in zip(edges, edges[1:], strict=False)]


def make_inputs(case: Case) -> dict:
    lp = case.randn(scale=0.5)
    return {
        "lp": lp,
        "old": lp + case.randn(scale=0.3),
        "adv": case.randn(),
        "mask": case.mask,
    }


@FAST
@given(
    case=cases(max_batch=10, holes=True),
    mode=st.sampled_from(AGG_MODE_NAMES),
    loss_name=st.sampled_from(sorted(LOSSES)),
    cuts=st.lists(st.integers(1, 9), max_size=5),
    world=st.integers(1, 3),
)
def test_loss_and_gradient_do_not_depend_on_the_split(case, mode, loss_name, cuts, world):
    fn, base = LOSSES[loss_name], make_inputs(case)
    norm = float(case.length)

    # Reference: the whole mini-batch at once.
    full_lp = base["lp"].clone().requires_grad_()
    full_loss = fn({**base, "lp": full_lp}, LossAggregation(mode, norm_length=norm))
    (full_grad,) = torch.autograd.grad(
        full_loss, full_lp, allow_unused=True, materialize_grads=True
    )

    # Split: micro-batches dealt round-robin to `world` simulated DP ranks.
    parts = split_rows(case.batch, cuts)
    counts = [token_and_seq_counts(base["mask"][rows]) for rows in parts]
    agg = LossAggregation(
        mode,
        global_token_count=sum(c[0] for c in counts),
        global_seq_count=sum(c[1] for c in counts),
        norm_length=norm,
    )
    total_loss = torch.zeros((), dtype=torch.float64)
    rank_grads = []
    for rank in range(world):
        lp = base["lp"].clone().requires_grad_()  # each rank holds its own replica
        rank_loss = (lp * 0).sum()  # a rank may get no micro-batch
        for rows in parts[rank::world]:
            micro = micro_batch({**base, "lp": lp}, rows)
            rank_loss = rank_loss + fn(micro, agg)
        total_loss = total_loss + rank_loss.detach()
        # As the aggregation docstring says: scale by world size, then DDP averages.
        (grad,) = torch.autograd.grad(
            rank_loss * world, lp, allow_unused=True, materialize_grads=True
        )
        rank_grads.append(grad)
    averaged = torch.stack(rank_grads).mean(dim=0)

    assert_close(total_loss, full_loss.detach(), atol=1e-12)
    assert_close(averaged, full_grad, atol=1e-12)


def test_local_counts_are_the_single_micro_batch_mean():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.float64)
    loss_mat = torch.tensor([[1.0, 2.0, 9.0], [6.0, 9.0, 9.0]], dtype=torch.float64)
    assert float(aggregate_loss(loss_mat, mask, "token-mean")) == 3.0
    assert float(aggregate_loss(loss_mat, mask, "seq-mean-token-sum")) == 4.5
    assert float(aggregate_loss(loss_mat, mask, "seq-mean-token-mean")) == 3.75
    assert float(aggregate_loss(loss_mat, mask, "seq-mean-token-sum-norm", norm_length=3)) == 1.5
    # With mini-batch totals the same micro-batch is a share of a larger mean.
    share = aggregate_loss(loss_mat, mask, "token-mean", global_token_count=6)
    assert float(share) == 1.5
    assert token_and_seq_counts(torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])) == (3, 2)
