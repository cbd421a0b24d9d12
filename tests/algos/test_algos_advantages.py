"""Advantage estimators against plain-loop references, closed forms and input handling."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from algos_testlib import FAST, Case, assert_close, cases, loop_whiten, valid_positions
from hypothesis import given
from hypothesis import strategies as st

from rayrl.algos import (
    ADV_ESTIMATORS,
    compute_advantages,
    gae_advantages,
    grpo_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    remax_advantages,
    rloo_advantages,
)
from rayrl.algos.advantages import token_rewards

# ---------------------------------------------------------------- loop references


def ref_gae(rewards, values, mask, gamma, lam):
    adv = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        pos = valid_positions(mask, i)
        running = 0.0
        for k in reversed(range(len(pos))):
            t = pos[k]
            next_v = float(values[i, pos[k + 1]]) if k + 1 < len(pos) else 0.0
            delta = float(rewards[i, t]) + gamma * next_v - float(values[i, t])
            running = delta + gamma * lam * running
            adv[i, t] = running
    returns = (adv + values) * mask
    return adv, returns


def ref_returns(rewards, mask, gamma):
    out = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        running = 0.0
        for t in reversed(valid_positions(mask, i)):
            running = float(rewards[i, t]) + gamma * running
            out[i, t] = running
    return out


def groups_of(index):
    groups: dict[str, list[int]] = {}
    for i, uid in enumerate(index):
        groups.setdefault(str(uid), []).append(i)
    return groups


def ref_grpo_scores(scores, index, eps, norm):
    out = [0.0] * len(scores)
    for members in groups_of(index).values():
        vals = [float(scores[i]) for i in members]
        n = len(vals)
        mean = sum(vals) / n if n > 1 else 0.0
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1)) if n > 1 else 1.0
        for i in members:
            out[i] = (float(scores[i]) - mean) / (std + eps) if norm else float(scores[i]) - mean
    return torch.tensor(out, dtype=torch.float64)


def ref_rloo_scores(scores, index):
    out = [0.0] * len(scores)
    for members in groups_of(index).values():
        for i in members:
            others = [float(scores[j]) for j in members if j != i]
            baseline = sum(others) / len(others) if others else 0.0
            out[i] = float(scores[i]) - baseline
    return torch.tensor(out, dtype=torch.float64)


def spread(per_seq, mask):
    return per_seq.unsqueeze(-1) * mask


def sparse_rewards(case: Case):
    """A reward on each row's last real token, as reward functions produce."""
    return token_rewards(case.randn(case.batch), case.mask)


# ---------------------------------------------------------------- estimators vs references


@FAST
@given(case=cases(holes=True), gamma=st.sampled_from([1.0, 0.9]), lam=st.sampled_from([1.0, 0.8]))
def test_gae_matches_loop_reference(case, gamma, lam):
    rewards, values = case.randn(), case.randn()
    adv, ret = gae_advantages(rewards, case.mask, values, gamma=gamma, lam=lam, whiten=False)
    ref_adv, ref_ret = ref_gae(rewards, values, case.mask, gamma, lam)
    assert_close(adv, ref_adv)
    assert_close(ret, ref_ret)
    whitened, _ = gae_advantages(rewards, case.mask, values, gamma=gamma, lam=lam)
    assert_close(whitened, loop_whiten(ref_adv, case.mask), atol=1e-6)


@FAST
@given(case=cases(), gamma=st.sampled_from([1.0, 0.95]))
def test_gae_lambda_one_is_discounted_return_minus_value(case, gamma):
    rewards, values = case.randn(), case.randn()
    adv, _ = gae_advantages(rewards, case.mask, values, gamma=gamma, lam=1.0, whiten=False)
    expected = (ref_returns(rewards, case.mask, gamma) - values) * case.mask
    assert_close(adv, expected)


@FAST
@given(case=cases(), groups=st.integers(1, 4), eps=st.sampled_from([1e-6, 0.1]), norm=st.booleans())
def test_grpo_matches_loop_reference(case, groups, eps, norm):
    rewards, index = sparse_rewards(case), case.group_index(groups)
    adv, ret = grpo_advantages(rewards, case.mask, index, epsilon=eps, norm_adv_by_std_in_grpo=norm)
    expected = spread(ref_grpo_scores(rewards.sum(-1), index, eps, norm), case.mask)
    assert_close(adv, expected, atol=1e-7)
    assert torch.equal(adv, ret)


@FAST
@given(case=cases(min_batch=2), groups=st.integers(1, 3))
def test_grpo_advantages_sum_to_zero_per_group(case, groups):
    scores = case.randn(case.batch)
    index = case.group_index(groups)
    full = torch.ones(case.batch, 1, dtype=torch.float64)
    adv, _ = grpo_advantages(scores, full, index)
    for members in groups_of(index).values():
        if len(members) > 1:
            assert abs(float(adv[members, 0].sum())) < 1e-9


@FAST
@given(case=cases(), groups=st.integers(1, 4))
def test_rloo_matches_loop_reference(case, groups):
    rewards, index = sparse_rewards(case), case.group_index(groups)
    adv, ret = rloo_advantages(rewards, case.mask, index)
    assert_close(adv, spread(ref_rloo_scores(rewards.sum(-1), index), case.mask))
    assert torch.equal(adv, ret)


def test_rloo_baseline_leaves_the_sample_out():
    scores = torch.tensor([1.0, 2.0, 6.0, 5.0], dtype=torch.float64)
    adv, _ = rloo_advantages(scores, torch.ones(4, 1, dtype=torch.float64), ["a", "a", "a", "b"])
    # sample 0: 1 - mean(2, 6) = -3; sample 2: 6 - mean(1, 2) = 4.5; lone sample keeps score.
    assert adv[:, 0].tolist() == [-3.0, 2.0 - 3.5, 4.5, 5.0]


@FAST
@given(case=cases(holes=True), gamma=st.sampled_from([1.0, 0.9]))
def test_reinforce_plus_plus_matches_loop_reference(case, gamma):
    rewards = case.randn()
    adv, ret = reinforce_plus_plus_advantages(rewards, case.mask, gamma=gamma)
    expected_ret = ref_returns(rewards, case.mask, gamma)
    assert_close(ret, expected_ret)
    assert_close(adv, loop_whiten(expected_ret, case.mask), atol=1e-6)


@FAST
@given(case=cases(), groups=st.integers(1, 4))
def test_reinforce_plus_plus_baseline_matches_loop_reference(case, groups):
    rewards, index = sparse_rewards(case), case.group_index(groups)
    adv, ret = reinforce_plus_plus_baseline_advantages(rewards, case.mask, index)
    centred = ref_grpo_scores(rewards.sum(-1), index, eps=0.0, norm=False)
    assert_close(adv, loop_whiten(spread(centred, case.mask), case.mask), atol=1e-6)
    assert torch.equal(adv, ret)


@FAST
@given(case=cases(holes=True))
def test_remax_matches_loop_reference(case):
    rewards, baselines = case.randn(), case.randn(case.batch)
    adv, ret = remax_advantages(rewards, case.mask, baselines)
    expected_ret = ref_returns(rewards, case.mask, 1.0)
    assert_close(ret, expected_ret)
    assert_close(adv, (expected_ret - baselines.unsqueeze(-1)) * case.mask)


# ---------------------------------------------------------------- conventions


@FAST
@given(case=cases(holes=True))
def test_every_estimator_zeroes_padding_and_stays_finite(case):
    inputs = dict(
        token_level_rewards=case.randn(),
        response_mask=case.mask,
        index=case.group_index(2),
        values=case.randn(),
        reward_baselines=case.randn(case.batch),
        old_log_probs=-case.randn().abs(),
        sum_pi_squared=case.randn().abs().clamp(max=1),
        gamma=0.99,
        lam=0.95,
    )
    for name in ADV_ESTIMATORS.names():
        adv, ret = compute_advantages(name, **inputs)
        assert adv.shape == ret.shape == case.mask.shape, name
        assert torch.isfinite(adv).all() and torch.isfinite(ret).all(), name
        assert (adv[case.mask == 0] == 0).all() and (ret[case.mask == 0] == 0).all(), name


def test_sequence_scores_equal_last_token_rewards():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.float64)
    scores = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)
    placed = token_rewards(scores, mask)
    assert placed.tolist() == [[0, 0, 1.0, 0], [-2.0, 0, 0, 0], [0, 0, 0, 0]]
    index = np.array(["p", "p", "q"], dtype=object)
    for name in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
        a = compute_advantages(name, token_level_rewards=scores, response_mask=mask, index=index)
        b = compute_advantages(name, token_level_rewards=placed, response_mask=mask, index=index)
        assert_close(a[0], b[0])


def test_group_index_forms_agree():
    scores = torch.tensor([1.0, 3.0, 2.0, 7.0, 0.5], dtype=torch.float64)
    mask = torch.ones(5, 2, dtype=torch.float64)
    forms = [
        np.array(["x", "y", "x", "y", "z"], dtype=object),
        ["x", "y", "x", "y", "z"],
        torch.tensor([10, 4, 10, 4, 99]),
        np.array([10, 4, 10, 4, 99]),
    ]
    results = [grpo_advantages(scores, mask, form)[0] for form in forms]
    for other in results[1:]:
        assert torch.equal(results[0], other)


def test_dr_grpo_is_grpo_without_std():
    scores = torch.tensor([1.0, 3.0, 2.0, 10.0], dtype=torch.float64)
    mask = torch.ones(4, 1, dtype=torch.float64)
    dr, _ = compute_advantages(
        "dr_grpo", token_level_rewards=scores, response_mask=mask, index=[0, 0, 1, 1]
    )
    assert dr[:, 0].tolist() == [-1.0, 1.0, -4.0, 4.0]


def test_compute_advantages_errors_are_actionable():
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match="needs input.*values.*critic"):
        compute_advantages("gae", token_level_rewards=torch.ones(2, 3), response_mask=mask)
    with pytest.raises(ValueError, match="reward_baselines"):
        compute_advantages("remax", token_level_rewards=torch.ones(2, 3), response_mask=mask)
    with pytest.raises(LookupError, match="Did you mean 'grpo'.*algorithm.adv_estimator"):
        compute_advantages("gpro", token_level_rewards=torch.ones(2, 3), response_mask=mask)
    assert ADV_ESTIMATORS.info("gae")["needs_critic"] is True
    assert ADV_ESTIMATORS.info("grpo")["needs_critic"] is False


def test_huge_rewards_keep_their_learning_signal():
    """A reward of 1e30 on half the samples: float32 squared deviations overflowed, every
    std became inf and every GRPO advantage 0; the group sums run in float64."""
    from rayrl.algos import compute_advantages

    mask = torch.ones(4, 3)
    rewards = torch.zeros(4, 3)
    rewards[[0, 2], -1] = 1e30
    adv, _ = compute_advantages(
        "grpo", token_level_rewards=rewards, response_mask=mask, index=["a", "a", "b", "b"]
    )
    assert torch.isfinite(adv).all()
    expected = torch.tensor([1.0, -1.0, 1.0, -1.0]) / 2**0.5  # +-(d / (d * sqrt 2))
    torch.testing.assert_close(adv[:, 0], expected, rtol=1e-5, atol=0)


def test_scores_beyond_float32_fail_and_extreme_ones_are_told():
    from rayrl.rewards.result import to_result
    from rayrl.trainer.advantage import warn_extreme_scores

    assert to_result(1e300).error and "beyond float32" in to_result(1e300).error
    assert to_result(1e30).ok and to_result(1e30).score == 1e30
    said: list[str] = []
    assert not warn_extreme_scores(torch.tensor([0.0, 1.0, -3.0]), said.append)
    assert warn_extreme_scores(torch.tensor([0.0, 1e30, 1.0]), said.append)
    assert "1 of 3 scores are beyond" in said[0] and "1e+30" in said[0]
