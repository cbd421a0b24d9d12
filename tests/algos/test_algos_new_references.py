"""GPG, the optimal token baseline, GMPO, CISPO, SAPO and PF-PPO against plain-loop
references written from the papers' definitions (per response, per token), gradients
included; split invariance of the sequence-mean losses; and checks that the references
tell a mutated algorithm (swapped clip bounds or temperatures, a baseline over the
wrong group) from the right one."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from algos_testlib import AGG_MODE_NAMES, FAST, assert_close, cases, loop_aggregate
from hypothesis import given
from hypothesis import strategies as st

from rayrl.algos import (
    POLICY_LOSSES,
    LossAggregation,
    PolicyLossConfig,
    cispo_policy_loss,
    geo_mean_policy_loss,
    gpg_advantages,
    optimal_token_baseline_advantages,
    pf_ppo_resample,
    pf_ppo_weights,
    reinforce_policy_loss,
    sapo_policy_loss,
    token_and_seq_counts,
)

CLIPS = [PolicyLossConfig(), PolicyLossConfig(clip_ratio_low=0.1, clip_ratio_high=0.4)]


def real(mask, i):
    return [t for t in range(mask.shape[1]) if mask[i, t] > 0]


def scores_of(case, sparse=True):
    """Scores ``[batch]`` (about a third exactly 0) and their token rewards on the last
    real token of each response (all-padding rows keep no reward)."""
    scores = case.randn(case.batch)
    if sparse:
        scores = torch.where(torch.rand(case.batch, generator=case.gen) < 0.35, 0.0, scores)
    rewards = torch.zeros(case.batch, case.length, dtype=torch.float64)
    for i in range(case.batch):
        pos = real(case.mask, i)
        if pos:
            rewards[i, pos[-1]] = scores[i]
    return rewards


# ----------------------------------------------------------------------------- GPG


def ref_gpg(rewards, mask, index):
    """A_i = alpha (s_i - mean of i's group), alpha = B / #(non-zero scores) (verl's)."""
    scores = [float(rewards[i].sum()) for i in range(rewards.shape[0])]
    nonzero = sum(1 for s in scores if s != 0)
    alpha = len(scores) / max(nonzero, 1)
    out = torch.zeros_like(rewards)
    for i, s in enumerate(scores):
        group = [scores[j] for j in range(len(scores)) if index[j] == index[i]]
        mean = sum(group) / len(group) if len(group) > 1 else 0.0
        for t in real(mask, i):
            out[i, t] = alpha * (s - mean)
    return out


@FAST
@given(case=cases(max_batch=12, holes=True), groups=st.integers(1, 4))
def test_gpg_matches_loop_reference(case, groups):
    rewards, index = scores_of(case), case.group_index(groups)
    adv, returns = gpg_advantages(rewards, case.mask, index)
    assert_close(adv, ref_gpg(rewards, case.mask, index))
    assert_close(returns, adv)


def test_gpg_reference_tells_the_wrong_group_apart():
    """Computing the baseline over another grouping (or none) changes the advantages."""
    mask = torch.ones(6, 3, dtype=torch.float64)
    rewards = torch.zeros(6, 3, dtype=torch.float64)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 1.0, 5.0, 3.0, 0.0], dtype=torch.float64)
    index = np.array(["a", "a", "a", "b", "b", "b"], dtype=object)
    expected = ref_gpg(rewards, mask, index)
    assert_close(gpg_advantages(rewards, mask, index)[0], expected)
    wrong = np.array(["a", "b", "a", "b", "a", "b"], dtype=object)
    assert (gpg_advantages(rewards, mask, wrong)[0] - expected).abs().max() > 0.5
    assert expected[0, 0] == pytest.approx(6 / 4 * (1 - 2 / 3))  # 4 non-zero scores of 6


# --------------------------------------------------------------- optimal token baseline


def ref_otb(rewards, mask, index, old, spi, is_w=None, zero_tail=True, eps=1e-8):
    """B_t = sum_j G_jt W_jt / (sum_j W_jt + eps) over the real tokens of i's group at t,
    W_jt = sum_{k <= t, real} (1 - 2 pi_jk + sum pi^2_jk) rho_jk^2; A = G - B."""
    batch, length = rewards.shape
    G = torch.zeros_like(rewards)
    W = torch.zeros_like(rewards)
    for i in range(batch):
        pos = real(mask, i)
        for t in pos:
            G[i, t] = sum(float(rewards[i, k]) for k in pos if k >= t)
            W[i, t] = sum(
                (1 - 2 * math.exp(float(old[i, k])) + float(spi[i, k]))
                * (float(is_w[i, k]) ** 2 if is_w is not None else 1.0)
                for k in pos
                if k <= t
            )
    adv = torch.zeros_like(rewards)
    for i in range(batch):
        group = [j for j in range(batch) if index[j] == index[i]]
        lengths = sorted(len(real(mask, j)) for j in group)
        mine = len(real(mask, i))
        tail_from = length
        if zero_tail and len(group) > 1 and mine == lengths[-1] and lengths[-2] < mine:
            tail_from = lengths[-2]
        for t in real(mask, i):
            baseline = 0.0
            if len(group) > 1 and t < tail_from:
                num = sum(float(G[j, t] * W[j, t]) for j in group if mask[j, t] > 0)
                den = sum(float(W[j, t]) for j in group if mask[j, t] > 0)
                baseline = num / (den + eps)
            adv[i, t] = float(G[i, t]) - baseline
    return adv, G


@FAST
@given(
    case=cases(max_batch=10, holes=True),
    groups=st.integers(1, 3),
    zero_tail=st.booleans(),
    with_is=st.booleans(),
)
def test_optimal_token_baseline_matches_loop_reference(case, groups, zero_tail, with_is):
    rewards, index = scores_of(case, sparse=False), case.group_index(groups)
    old = -torch.rand(case.batch, case.length, generator=case.gen, dtype=torch.float64) * 3
    spi = torch.rand(case.batch, case.length, generator=case.gen, dtype=torch.float64)
    is_w = torch.rand(case.batch, case.length, generator=case.gen, dtype=torch.float64) + 0.5
    is_w = is_w if with_is else None
    adv, returns = optimal_token_baseline_advantages(
        rewards, case.mask, index, old, spi, is_w, handle_zero_tail=zero_tail
    )
    ref_adv, ref_returns = ref_otb(rewards, case.mask, index, old, spi, is_w, zero_tail)
    assert_close(adv, ref_adv)
    assert_close(returns, ref_returns)


def test_optimal_token_baseline_reference_tells_the_wrong_group_apart():
    gen = torch.Generator().manual_seed(5)
    mask = torch.ones(6, 4, dtype=torch.float64)
    rewards = torch.zeros(6, 4, dtype=torch.float64)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 1.0, 5.0, 3.0, 4.0], dtype=torch.float64)
    old = -torch.rand(6, 4, generator=gen, dtype=torch.float64)
    spi = torch.rand(6, 4, generator=gen, dtype=torch.float64)
    index = np.array(["a", "a", "a", "b", "b", "b"], dtype=object)
    expected, _ = ref_otb(rewards, mask, index, old, spi)
    assert_close(optimal_token_baseline_advantages(rewards, mask, index, old, spi)[0], expected)
    wrong = np.array(["a", "b", "a", "b", "a", "b"], dtype=object)
    got, _ = optimal_token_baseline_advantages(rewards, mask, wrong, old, spi)
    assert (got - expected).abs().max() > 0.5
    # with the same path weights for all, the baseline is the group's mean return
    flat, _ = optimal_token_baseline_advantages(rewards, mask, index, old * 0, spi * 0 + 0.5)
    torch.testing.assert_close(flat[:3, 0], rewards[:3, -1] - 2 / 3)


# ---------------------------------------------------------------------------- GMPO


def ref_gmpo(lp, old, adv, mask, cfg, is_w=None):
    """Mean over responses of -A_i * exp(mean_t clip_t(log r_t)), the clip on the side
    sgn(A) pushes to: A > 0 caps log r at +high, A < 0 floors it at -low."""
    terms = []
    for i in range(lp.shape[0]):
        pos = real(mask, i)
        if not pos:
            continue
        a = sum(float(adv[i, t]) for t in pos) / len(pos)
        kept = []
        for t in pos:
            log_r = lp[i, t] - old[i, t]
            if adv[i, t] > 0:
                kept.append(torch.clamp(log_r, max=cfg.clip_ratio_high))
            elif adv[i, t] < 0:
                kept.append(torch.clamp(log_r, min=-cfg.clip_ratio_low))
            else:
                kept.append(log_r * 0)
        term = -a * torch.exp(sum(kept) / len(pos))
        if is_w is not None:
            term = term * math.exp(sum(math.log(float(is_w[i, t]) + 1e-10) for t in pos) / len(pos))
        terms.append(term)
    return sum(terms) / len(terms) if terms else lp.sum() * 0


@FAST
@given(case=cases(holes=True), cfg=st.sampled_from(CLIPS), with_is=st.booleans())
def test_gmpo_value_and_gradient_match_loop_reference(case, cfg, with_is):
    lp = case.randn(scale=0.5).requires_grad_()
    old = lp.detach() + case.randn(scale=0.3)
    adv = case.randn(case.batch).unsqueeze(-1).expand(case.batch, case.length)
    is_w = case.randn().abs() + 0.1 if with_is else None
    loss, _ = geo_mean_policy_loss(lp, old, adv, case.mask, config=cfg, is_weights=is_w)
    (grad,) = torch.autograd.grad(loss, lp, materialize_grads=True, allow_unused=True)
    ref_lp = lp.detach().clone().requires_grad_()
    expected = ref_gmpo(ref_lp, old, adv, case.mask, cfg, is_w)
    (ref_grad,) = torch.autograd.grad(expected, ref_lp, materialize_grads=True, allow_unused=True)
    assert_close(loss, torch.as_tensor(expected))
    assert_close(grad, ref_grad)


def test_gmpo_ignores_the_aggregation_mode_and_empty_responses():
    gen = torch.Generator().manual_seed(1)
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.float64)
    lp = torch.randn(3, 4, generator=gen, dtype=torch.float64) * 0.3
    old = lp + torch.randn(3, 4, generator=gen, dtype=torch.float64) * 0.3
    adv = torch.tensor([[1.0], [2.0], [-0.5]], dtype=torch.float64).expand(3, 4)
    expected = ref_gmpo(lp, old, adv, mask, PolicyLossConfig())  # mean over the 2 responses
    for mode in AGG_MODE_NAMES:
        loss, _ = geo_mean_policy_loss(lp, old, adv, mask, agg=LossAggregation(mode))
        assert_close(loss, torch.as_tensor(expected))


# --------------------------------------------------------------------------- CISPO


def ref_cispo(lp, old, adv, mask, cfg, mode):
    """Per token -sg[clip(r, 1 - low, 1 + high)] * A * log pi, aggregated by ``mode``."""
    losses = torch.zeros_like(lp)
    clipped = []
    for i in range(lp.shape[0]):
        for t in real(mask, i):
            r = math.exp(float(lp[i, t].detach() - old[i, t]))
            w = min(max(r, 1 - cfg.clip_ratio_low), 1 + cfg.clip_ratio_high)
            clipped.append(w != r)
            losses[i, t] = -w * adv[i, t] * lp[i, t]
    frac = sum(clipped) / len(clipped) if clipped else 0.0
    return loop_aggregate(losses, mask, mode), frac


@FAST
@given(case=cases(holes=True), cfg=st.sampled_from(CLIPS), mode=st.sampled_from(AGG_MODE_NAMES))
def test_cispo_value_gradient_and_clipfrac_match_loop_reference(case, cfg, mode):
    lp = (case.randn(scale=0.5) - 1).requires_grad_()
    old = lp.detach() + case.randn(scale=0.3)
    adv = case.randn()
    loss, metrics = cispo_policy_loss(
        lp, old, adv, case.mask, config=cfg, agg=LossAggregation(mode)
    )
    (grad,) = torch.autograd.grad(loss, lp, materialize_grads=True, allow_unused=True)
    ref_lp = lp.detach().clone().requires_grad_()
    expected, frac = ref_cispo(ref_lp, old, adv, case.mask, cfg, mode)
    (ref_grad,) = torch.autograd.grad(
        torch.as_tensor(expected) + ref_lp.sum() * 0, ref_lp, materialize_grads=True
    )
    assert_close(loss, torch.as_tensor(expected))
    assert_close(grad, ref_grad)
    assert abs(float(metrics["pg_clipfrac"]) - frac) < 1e-12


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    """PPO drops a token whose ratio left the clip range; CISPO weights it by the bound."""
    lp = torch.tensor([[0.5]], dtype=torch.float64, requires_grad=True)  # r = e^0.5 > 1.2
    old, adv, mask = torch.zeros(1, 1, dtype=torch.float64), torch.ones(1, 1), torch.ones(1, 1)
    loss, metrics = cispo_policy_loss(lp, old, adv, mask)
    loss.backward()
    assert float(lp.grad) == pytest.approx(-1.2) and float(metrics["pg_clipfrac"]) == 1.0


# ---------------------------------------------------------------------------- SAPO


def ref_sapo(lp, old, adv, mask, tau_pos, tau_neg):
    """Mean over responses of the token mean of -f(r) A, f(r) = sigmoid(tau (r - 1)) 4 / tau,
    tau = tau_pos where A > 0 else tau_neg."""
    losses = torch.zeros_like(lp)
    for i in range(lp.shape[0]):
        for t in real(mask, i):
            tau = tau_pos if adv[i, t] > 0 else tau_neg
            r = torch.exp(lp[i, t] - old[i, t])
            losses[i, t] = -torch.sigmoid(tau * (r - 1)) * 4 / tau * adv[i, t]
    return loop_aggregate(losses, mask, "seq-mean-token-mean")


@FAST
@given(
    case=cases(holes=True),
    taus=st.sampled_from([(1.0, 1.05), (0.5, 2.0), (3.0, 1.0)]),
    mode=st.sampled_from(AGG_MODE_NAMES),
)
def test_sapo_value_and_gradient_match_loop_reference(case, taus, mode):
    cfg = PolicyLossConfig(tau_pos=taus[0], tau_neg=taus[1])
    lp = case.randn(scale=0.5).requires_grad_()
    old = lp.detach() + case.randn(scale=0.3)
    adv = case.randn()
    loss, _ = sapo_policy_loss(lp, old, adv, case.mask, config=cfg, agg=LossAggregation(mode))
    (grad,) = torch.autograd.grad(loss, lp, materialize_grads=True, allow_unused=True)
    ref_lp = lp.detach().clone().requires_grad_()
    expected = ref_sapo(ref_lp, old, adv, case.mask, *taus)
    (ref_grad,) = torch.autograd.grad(
        torch.as_tensor(expected) + ref_lp.sum() * 0, ref_lp, materialize_grads=True
    )
    assert_close(loss, torch.as_tensor(expected))
    assert_close(grad, ref_grad)


def test_sapo_on_policy_gradient_is_the_policy_gradient():
    """f'(1) = 1: at r = 1 SAPO's gradient is REINFORCE's, whatever the temperatures."""
    gen = torch.Generator().manual_seed(2)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.float64)
    adv = torch.randn(2, 4, generator=gen, dtype=torch.float64)
    agg = LossAggregation("seq-mean-token-mean")
    lp = (torch.randn(2, 4, generator=gen, dtype=torch.float64) - 1).requires_grad_()
    cfg = PolicyLossConfig(tau_pos=0.7, tau_neg=2.5)
    (sapo,) = torch.autograd.grad(sapo_policy_loss(lp, lp.detach(), adv, mask, config=cfg)[0], lp)
    (pg,) = torch.autograd.grad(reinforce_policy_loss(lp, lp.detach(), adv, mask, agg=agg)[0], lp)
    assert_close(sapo, pg)


# ------------------------------------------------------------ mutations are caught


def _fixed_batch():
    gen = torch.Generator().manual_seed(11)
    mask = torch.ones(6, 5, dtype=torch.float64)
    mask[1, 3:] = 0
    lp = -torch.rand(6, 5, generator=gen, dtype=torch.float64) - 0.5
    old = lp + torch.randn(6, 5, generator=gen, dtype=torch.float64) * 0.5
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0, 1.5, -0.3], dtype=torch.float64)
    return lp, old, adv.unsqueeze(-1).expand(6, 5), mask


def test_the_references_catch_swapped_clip_bounds_and_temperatures():
    lp, old, adv, mask = _fixed_batch()
    right = PolicyLossConfig(clip_ratio_low=0.1, clip_ratio_high=0.3, tau_pos=0.5, tau_neg=2.0)
    swapped = PolicyLossConfig(clip_ratio_low=0.3, clip_ratio_high=0.1, tau_pos=2.0, tau_neg=0.5)
    refs = {
        "geo_mean": ref_gmpo(lp, old, adv, mask, right),
        "cispo": ref_cispo(lp, old, adv, mask, right, "token-mean")[0],
        "sapo": ref_sapo(lp, old, adv, mask, right.tau_pos, right.tau_neg),
    }
    for name, expected in refs.items():
        fn = POLICY_LOSSES.get(name)
        assert abs(float(fn(lp, old, adv, mask, config=right)[0]) - float(expected)) < 1e-12
        assert abs(float(fn(lp, old, adv, mask, config=swapped)[0]) - float(expected)) > 1e-3


# ------------------------------------------------------------------ split invariance


@FAST
@given(
    case=cases(min_batch=2, max_batch=10, holes=True),
    name=st.sampled_from(["geo_mean", "sapo", "cispo"]),
    cut=st.integers(1, 9),
)
def test_micro_batch_shares_add_up_to_the_mini_batch_loss_and_gradient(case, name, cut):
    """GMPO and SAPO average over responses whatever ``agg`` says: with the mini-batch's
    global counts, the micro-batches' shares still sum to the whole (and so do grads)."""
    cut = min(cut, case.batch - 1)
    fn = POLICY_LOSSES.get(name)
    lp = case.randn(scale=0.5).requires_grad_()
    old = lp.detach() + case.randn(scale=0.3)
    adv = case.randn(case.batch).unsqueeze(-1).expand(case.batch, case.length)
    tokens, seqs = token_and_seq_counts(case.mask)
    agg = LossAggregation("token-mean", global_token_count=tokens, global_seq_count=seqs)
    whole, _ = fn(lp, old, adv, case.mask, agg=LossAggregation("token-mean"))
    (whole_grad,) = torch.autograd.grad(whole, lp, materialize_grads=True, allow_unused=True)
    parts = [slice(0, cut), slice(cut, case.batch)]
    shares = [fn(lp[s], old[s], adv[s], case.mask[s], agg=agg)[0] for s in parts]
    (split_grad,) = torch.autograd.grad(sum(shares), lp, materialize_grads=True, allow_unused=True)
    assert_close(sum(shares), whole)
    assert_close(split_grad, whole_grad)


# --------------------------------------------------------------------- padding junk


@pytest.mark.parametrize("name", ["geo_mean", "cispo", "sapo"])
def test_nan_in_padding_reaches_neither_loss_nor_gradient(name):
    lp, old, adv, mask = _fixed_batch()
    lp = torch.where(mask.bool(), lp, torch.nan).requires_grad_()
    old = torch.where(mask.bool(), old, torch.inf)
    adv = torch.where(mask.bool(), adv, torch.nan)
    loss, metrics = POLICY_LOSSES.get(name)(lp, old, adv, mask)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    assert all(torch.isfinite(v) for v in metrics.values())


# -------------------------------------------------------------------------- PF-PPO


def ref_pf_weights(scores, method, power):
    values = [float(s) for s in scores]
    if method == "pow":
        weights = [abs(v) ** power for v in values]
    elif method == "max_min":
        weights = [1.0 if v in (max(values), min(values)) else 0.0 for v in values]
    else:
        weights = [0.4 if v == max(values) else 0.1 for v in values]
    return torch.tensor([max(w + 1e-8, 1e-8) for w in weights], dtype=scores.dtype)


@pytest.mark.parametrize("method", ["pow", "max_min", "max_random"])
@pytest.mark.parametrize("power", [1.0, 2.0])
def test_pf_ppo_weights_and_draws_match_loop_reference(method, power):
    gen = torch.Generator().manual_seed(4)
    scores = torch.randn(9, generator=gen, dtype=torch.float64)
    scores[2] = scores[5] = 0.0
    weights = ref_pf_weights(scores, method, power)
    assert_close(pf_ppo_weights(scores, method, power), weights)
    rows = pf_ppo_resample(scores, method, power, torch.Generator().manual_seed(9))
    expected = torch.multinomial(weights, 9, True, generator=torch.Generator().manual_seed(9))
    assert torch.equal(rows, expected)


def test_pf_ppo_draws_follow_the_weights():
    """Over many draws each row's frequency is its weight's share (max_min: the extremes)."""
    scores = torch.tensor([0.0, 3.0, -1.0, 2.0, 0.5], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(5)
    for _ in range(400):
        rows = pf_ppo_resample(scores, "pow", 2.0, gen)
        counts += torch.bincount(rows, minlength=5)
    share = counts / counts.sum()
    expected = scores**2 / (scores**2).sum()
    assert (share - expected.float()).abs().max() < 0.02
    extremes = pf_ppo_resample(scores, "max_min", 2.0, torch.Generator().manual_seed(1))
    assert set(extremes.tolist()) <= {1, 2}


def test_pf_ppo_refuses_an_unknown_method_naming_the_key():
    with pytest.raises(LookupError, match=r"max_min.*algorithm\.pf_ppo\.reweight_method"):
        pf_ppo_weights(torch.ones(3), "maxmin")
