"""Advantages from one score per row (`rayrl.trainer.per_sequence`, the path of
`trainer.rows_on_workers`) against the estimators run over the whole token matrix:
broadcast on the masks by `expand_advantages`, the per-token advantages are bitwise
the estimator's; the token metrics equal up to rounding. Empty responses, groups of
one, and a mask a masking step cut shorter than the generated length included."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rayrl.algos import compute_advantages, expand_advantages
from rayrl.batch import Batch
from rayrl.config import load_config
from rayrl.trainer.metrics import spread
from rayrl.trainer.per_sequence import per_sequence_advantages, token_spread

ESTIMATORS = ["grpo", "dr_grpo", "rloo", "gpg"]


def _cfg(estimator: str, norm: bool):
    return load_config(
        "grpo",
        [
            f"algorithm.adv_estimator={estimator}",
            f"algorithm.norm_adv_by_std_in_grpo={norm}",
            "data.train_batch_size=2",
            "data.max_response_length=6",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        ],
    )


def _rows(seed: int):
    """Scores, groups, generated lengths (some 0), a response mask of those lengths and
    the token scores an estimator sees (each row's score on its last real token)."""
    gen = torch.Generator().manual_seed(seed)
    uids = np.array(["a"] * 4 + ["b"] * 4 + ["c"] * 3 + ["d"], dtype=object)
    lengths = torch.randint(0, 7, (len(uids),), generator=gen)
    lengths[[1, 9]] = 0  # empty responses, in a group of four and of three
    scores = torch.randn(len(uids), generator=gen).round(decimals=1)
    scores[4:8] = torch.tensor([1.0, 0.0, 0.0, 1.0])  # a binary group
    mask = (torch.arange(6).unsqueeze(0) < lengths.unsqueeze(-1)).long()
    token_scores = torch.zeros(len(uids), 6)
    real = lengths > 0
    token_scores[real, lengths[real] - 1] = scores[real]
    return uids, lengths, scores, mask, token_scores


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_one_score_per_row_broadcast_is_bitwise_the_estimators_advantages(estimator, norm, seed):
    uids, lengths, scores, mask, token_scores = _rows(seed)
    cfg = _cfg(estimator, norm)
    want, want_returns = compute_advantages(
        estimator,
        token_level_rewards=token_scores,
        response_mask=mask,
        index=uids,
        gamma=cfg.algorithm.gamma,
        lam=cfg.algorithm.lam,
        norm_adv_by_std_in_grpo=norm,
    )
    batch = Batch({"scores": scores, "response_length": lengths}, {"uid": uids})
    metrics = per_sequence_advantages(cfg, batch)
    assert batch["advantages"].shape == (len(uids),)
    got = expand_advantages(batch["advantages"], mask)
    assert torch.equal(got, want), (got - want).abs().max()
    assert torch.equal(expand_advantages(batch["returns"], mask), want_returns)
    expected = {
        **spread("critic/advantages", want, mask),
        **spread("critic/returns", want_returns, mask),
        **spread("critic/rewards", token_scores.sum(-1)),
    }
    assert metrics == pytest.approx(expected, rel=1e-6, abs=1e-7)


def test_a_mask_cut_after_generation_weighs_the_metrics_but_not_the_advantages():
    """A masking step (the controller holds `response_mask`, shorter than generated):
    the advantages stay those of the generated rows; the token metrics count the
    tokens the loss sees, as the estimator's own spread over that mask."""
    uids, lengths, scores, mask, token_scores = _rows(2)
    cut = mask.clone()
    cut[0] = 0  # a truncated sample masked out
    cfg = _cfg("grpo", True)
    batch = Batch({"scores": scores, "response_length": lengths, "response_mask": cut})
    batch.non_tensors["uid"] = uids
    metrics = per_sequence_advantages(cfg, batch)
    want, _ = compute_advantages(
        "grpo", token_level_rewards=token_scores, response_mask=cut, index=uids
    )
    assert torch.equal(expand_advantages(batch["advantages"], cut), want)
    assert metrics["critic/advantages/mean"] == pytest.approx(
        spread("critic/advantages", want, cut)["critic/advantages/mean"]
    )


def test_token_spread_weighs_rows_by_their_tokens_and_skips_empty_ones():
    values = torch.tensor([1.0, -2.0, 7.0])
    counts = torch.tensor([3, 1, 0])
    assert token_spread("x", values, counts) == {"x/mean": 0.25, "x/max": 1.0, "x/min": -2.0}
    assert token_spread("x", values, torch.zeros(3, dtype=torch.long)) == {}
