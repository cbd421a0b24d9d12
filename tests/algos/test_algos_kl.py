"""KL estimators, straight-through gradients, reward penalty, KL loss and controllers."""

from __future__ import annotations

import math

import pytest
import torch
from algos_testlib import FAST, assert_close, cases, loop_aggregate
from hypothesis import given
from hypothesis import strategies as st

from rayrl.algos import (
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    LossAggregation,
    apply_kl_penalty,
    kl_divergence,
    kl_loss,
    make_kl_controller,
)


def ref_estimate(name: str, lp: float, ref: float) -> float:
    d = lp - ref
    if name == "k1":
        return d
    if name == "abs":
        return abs(d)
    if name == "k2":
        return 0.5 * d * d
    neg = max(-20.0, min(20.0, -d))
    return max(-10.0, min(10.0, math.exp(neg) - neg - 1.0))


BASE = ["k1", "abs", "k2", "k3"]


@FAST
@given(case=cases(holes=True), name=st.sampled_from(BASE), straight=st.booleans())
def test_estimators_match_formulas(case, name, straight):
    lp, ref = case.randn(scale=3.0), case.randn(scale=3.0)
    got = kl_divergence(lp, ref, name + ("+" if straight else ""), case.mask)
    for i in range(case.batch):
        for t in range(case.length):
            expected = ref_estimate(name, float(lp[i, t]), float(ref[i, t]))
            expected = expected if case.mask[i, t] > 0 else 0.0
            assert abs(float(got[i, t]) - expected) < 1e-9 * max(1.0, abs(expected))


@pytest.mark.parametrize("name", BASE)
def test_straight_through_value_is_estimator_and_gradient_is_k2(name):
    gen = torch.Generator().manual_seed(0)
    lp = torch.randn(3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    ref = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    st_kl = kl_divergence(lp, ref, name + "+")
    assert torch.equal(st_kl.detach(), kl_divergence(lp, ref, name).detach())
    (grad,) = torch.autograd.grad(st_kl.sum(), lp)
    assert_close(grad, (lp - ref).detach())  # d/dlp of (lp - ref)^2 / 2


@pytest.mark.parametrize("name", BASE)
def test_gradcheck(name):
    gen = torch.Generator().manual_seed(1)
    lp = torch.randn(2, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    ref = lp.detach() + torch.randn(2, 5, generator=gen, dtype=torch.float64) * 0.5
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.float64)
    if name == "abs":  # keep away from the kink at 0
        ref = ref + 0.5 * torch.sign(lp.detach() - ref)
    assert torch.autograd.gradcheck(lambda x: kl_loss(x, ref, mask, estimator=name)[0], (lp,))


@pytest.mark.parametrize("name", [*BASE, *(n + "+" for n in BASE)])
@pytest.mark.parametrize("gap", [50.0, -50.0, -1000.0])
def test_no_nan_or_inf_at_extreme_gaps(name, gap):
    """verl#751: an unclamped exp in k3 overflowed into NaN losses (and gradients)."""
    for dtype in (torch.float32, torch.bfloat16):
        lp = torch.full((2, 3), -1.0, dtype=dtype, requires_grad=True)
        ref = (lp.detach() - gap).to(dtype)
        mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=dtype)
        loss, metrics = kl_loss(lp, ref, mask, estimator=name)
        (grad,) = torch.autograd.grad(loss, lp)
        assert torch.isfinite(loss) and torch.isfinite(grad).all(), (name, dtype)
        assert torch.isfinite(metrics["kl_loss"])


def test_k3_is_nonnegative_and_k1_is_unbiased_in_expectation():
    gen = torch.Generator().manual_seed(5)
    logits_p = torch.randn(20, dtype=torch.float64, generator=gen)
    logits_q = torch.randn(20, dtype=torch.float64, generator=gen)
    p, q = logits_p.log_softmax(-1), logits_q.log_softmax(-1)
    true_kl = float((p.exp() * (p - q)).sum())
    samples = torch.multinomial(p.exp(), 200_000, replacement=True, generator=gen)
    lp, ref = p[samples], q[samples]
    for name in ("k1", "k3"):
        estimate = float(kl_divergence(lp, ref, name).mean())
        assert estimate == pytest.approx(true_kl, rel=0.05), name
    assert (kl_divergence(lp, ref, "k3") >= 0).all()


@FAST
@given(case=cases(), coef=st.sampled_from([0.0, 0.05, 1.0]), name=st.sampled_from(BASE))
def test_apply_kl_penalty_matches_loop_reference(case, coef, name):
    scores, lp, ref = case.randn(), case.randn(), case.randn()
    rewards, metrics = apply_kl_penalty(scores, lp, ref, case.mask, coef, estimator=name)
    seq_means = []
    for i in range(case.batch):
        kls = []
        for t in range(case.length):
            if case.mask[i, t] > 0:
                kl = ref_estimate(name, float(lp[i, t]), float(ref[i, t]))
                kls.append(kl)
                assert float(rewards[i, t]) == pytest.approx(float(scores[i, t]) - coef * kl)
            else:
                assert float(rewards[i, t]) == 0.0
        seq_means.append(sum(kls) / len(kls) if kls else 0.0)
    assert float(metrics["reward_kl_penalty"]) == pytest.approx(sum(seq_means) / case.batch)
    assert float(metrics["reward_kl_penalty_coeff"]) == pytest.approx(coef)


@FAST
@given(case=cases(), mode=st.sampled_from(["token-mean", "seq-mean-token-mean"]))
def test_kl_loss_aggregates_like_the_policy_loss(case, mode):
    lp, ref = case.randn(), case.randn()
    loss, _ = kl_loss(lp, ref, case.mask, estimator="k3", agg=LossAggregation(mode))
    kl = kl_divergence(lp, ref, "k3", case.mask)
    assert_close(loss, torch.as_tensor(loop_aggregate(kl, case.mask, mode)))


def test_adaptive_controller_follows_ziegler_schedule():
    ctrl = AdaptiveKLController(kl_coef=0.2, target_kl=6.0, horizon=10_000)
    ctrl.update(current_kl=9.0, n_steps=256)  # error 0.5, clipped to 0.2
    assert ctrl.value == pytest.approx(0.2 * (1 + 0.2 * 256 / 10_000))
    before = ctrl.value
    ctrl.update(current_kl=5.4, n_steps=100)  # error -0.1
    assert ctrl.value == pytest.approx(before * (1 - 0.1 * 100 / 10_000))
    ctrl.update(current_kl=0.0, n_steps=10_000)  # error clipped to -0.2
    assert ctrl.value == pytest.approx(before * (1 - 0.1 * 100 / 10_000) * 0.8)
    restored = AdaptiveKLController(kl_coef=1.0, target_kl=6.0, horizon=10_000)
    restored.load_state_dict(ctrl.state_dict())
    assert restored.value == ctrl.value


def test_adaptive_controller_converges_towards_target():
    ctrl = AdaptiveKLController(kl_coef=1.0, target_kl=1.0, horizon=100)
    for _ in range(300):  # the observed KL falls as the coefficient grows
        ctrl.update(current_kl=2.0 / ctrl.value, n_steps=10)
    assert ctrl.value == pytest.approx(2.0, rel=0.05)


def test_fixed_controller_and_factory():
    fixed = make_kl_controller("fixed", kl_coef=0.01)
    fixed.update(100.0, 1000)
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.01
    adaptive = make_kl_controller("adaptive", kl_coef=0.1, target_kl=3.0, horizon=1000)
    assert isinstance(adaptive, AdaptiveKLController)
    with pytest.raises(ValueError, match="target_kl"):
        make_kl_controller("adaptive", kl_coef=0.1)
    with pytest.raises(LookupError, match="Did you mean 'adaptive'.*kl_ctrl.type"):
        make_kl_controller("adaptve")
    assert KL_CONTROLLERS.names() == ["fixed", "adaptive"]


def test_verl_names_are_aliases():
    assert KL_ESTIMATORS.canonical("low_var_kl") == "k3"
    assert KL_ESTIMATORS.canonical("low_var_kl+") == "k3+"
    assert KL_ESTIMATORS.canonical("mse") == "k2"
    assert KL_ESTIMATORS.canonical("kl") == "k1"
    with pytest.raises(LookupError, match="Did you mean 'low_var_kl'.*Valid names: abs"):
        kl_divergence(torch.zeros(1), torch.zeros(1), "lowvar_kl")
