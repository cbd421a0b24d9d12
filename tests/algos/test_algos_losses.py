"""Policy and value losses against loop references, gradients, and extreme inputs."""

from __future__ import annotations

import math

import pytest
import torch
from algos_testlib import AGG_MODE_NAMES, FAST, assert_close, cases, loop_aggregate
from hypothesis import given
from hypothesis import strategies as st

from rayrl.algos import (
    POLICY_LOSSES,
    LossAggregation,
    PolicyLossConfig,
    gspo_policy_loss,
    ppo_policy_loss,
    reinforce_policy_loss,
    truncated_is_weights,
    value_loss,
)

CONFIGS = [
    PolicyLossConfig(),
    PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=None),
    PolicyLossConfig(clip_ratio_low=0.1, clip_ratio_high=0.3, clip_ratio_c=1.5),
]

# ---------------------------------------------------------------- loop references


def ref_ppo_token(lp, old, adv, cfg):
    ratio = math.exp(max(-cfg.log_ratio_clamp, min(cfg.log_ratio_clamp, lp - old)))
    clipped_ratio = min(max(ratio, 1 - cfg.clip_ratio_low), 1 + cfg.clip_ratio_high)
    loss = max(-adv * ratio, -adv * clipped_ratio)
    clip_active = -adv * clipped_ratio > -adv * ratio
    lower_active = False
    if cfg.clip_ratio_c is not None and adv < 0:
        lower_active = loss > -adv * cfg.clip_ratio_c
        loss = min(loss, -adv * cfg.clip_ratio_c)
    return loss, clip_active, lower_active


def ref_ppo(lp, old, adv, mask, cfg, mode):
    losses = torch.zeros_like(lp)
    clips, lowers, kls = [], [], []
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if mask[i, t] > 0:
                loss, c, low = ref_ppo_token(
                    float(lp[i, t]), float(old[i, t]), float(adv[i, t]), cfg
                )
                losses[i, t] = loss
                clips.append(c)
                lowers.append(low)
                kls.append(float(old[i, t] - lp[i, t]))
    mean = lambda xs: sum(map(float, xs)) / len(xs) if xs else 0.0  # noqa: E731
    metrics = {"pg_clipfrac": mean(clips), "pg_clipfrac_lower": mean(lowers), "ppo_kl": mean(kls)}
    return loop_aggregate(losses, mask, mode), metrics


def ref_gspo_sequence_objective(lp, old, seq_adv, mask, cfg):
    """The paper's objective: mean over sequences of max(-A s, -A clip(s)), s from lp."""
    terms = []
    for i in range(lp.shape[0]):
        pos = [t for t in range(lp.shape[1]) if mask[i, t] > 0]
        if not pos:
            continue
        s = torch.exp(sum(lp[i, t] - old[i, t] for t in pos) / len(pos))
        clipped = s.clamp(1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high)
        terms.append(torch.maximum(-seq_adv[i] * s, -seq_adv[i] * clipped))
    return sum(terms) / len(terms) if terms else lp.sum() * 0


# ---------------------------------------------------------------- tests


@FAST
@given(case=cases(), cfg=st.sampled_from(CONFIGS), mode=st.sampled_from(AGG_MODE_NAMES))
def test_ppo_matches_loop_reference(case, cfg, mode):
    lp = case.randn(scale=0.5)
    old = lp + case.randn(scale=0.3)
    adv = case.randn()
    loss, metrics = ppo_policy_loss(lp, old, adv, case.mask, config=cfg, agg=LossAggregation(mode))
    expected, ref_metrics = ref_ppo(lp, old, adv, case.mask, cfg, mode)
    assert_close(loss, torch.as_tensor(expected, dtype=torch.float64))
    for name, value in ref_metrics.items():
        assert abs(float(metrics[name]) - value) < 1e-9, name


@FAST
@given(case=cases(), mode=st.sampled_from(AGG_MODE_NAMES))
def test_reinforce_matches_loop_reference(case, mode):
    lp, adv = case.randn(), case.randn()
    loss, _ = reinforce_policy_loss(lp, lp.detach(), adv, case.mask, agg=LossAggregation(mode))
    assert_close(loss, torch.as_tensor(loop_aggregate(-adv * lp, case.mask, mode)))


@FAST
@given(case=cases(), cfg=st.sampled_from(CONFIGS))
def test_gspo_value_and_gradient_match_the_sequence_level_objective(case, cfg):
    lp = case.randn(scale=0.5).requires_grad_()
    old = lp.detach() + case.randn(scale=0.05)
    seq_adv = case.randn(case.batch)
    adv = seq_adv.unsqueeze(-1).expand(case.batch, case.length)
    agg = LossAggregation("seq-mean-token-mean")
    loss, _ = gspo_policy_loss(lp, old, adv, case.mask, config=cfg, agg=agg)
    (grad,) = torch.autograd.grad(loss, lp, allow_unused=True, materialize_grads=True)
    ref_lp = lp.detach().clone().requires_grad_()
    expected = ref_gspo_sequence_objective(ref_lp, old, seq_adv, case.mask, cfg)
    (ref_grad,) = torch.autograd.grad(expected, ref_lp, allow_unused=True, materialize_grads=True)
    assert_close(loss, torch.as_tensor(expected))
    assert_close(grad, ref_grad)


@pytest.mark.parametrize("name", ["ppo", "gspo", "reinforce"])
@pytest.mark.parametrize("mode", AGG_MODE_NAMES)
def test_policy_loss_gradcheck(name, mode):
    gen = torch.Generator().manual_seed(3)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.float64)
    lp = (torch.randn(3, 5, generator=gen, dtype=torch.float64) * 0.3).requires_grad_()
    old = lp.detach() + torch.randn(3, 5, generator=gen, dtype=torch.float64) * 0.3
    adv = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    weights = torch.rand(3, 5, generator=gen, dtype=torch.float64) + 0.5
    if name == "gspo":  # GSPO's gradient is the objective's for per-sequence A and weights
        adv, weights = adv[:, :1].expand(3, 5), weights[:, :1].expand(3, 5)
    fn, agg = POLICY_LOSSES.get(name), LossAggregation(mode)

    def loss(x):
        return fn(x, old, adv, mask, agg=agg, is_weights=weights)[0]

    assert torch.autograd.gradcheck(loss, (lp,), eps=1e-6, atol=1e-7)


@FAST
@given(case=cases(), clip=st.sampled_from([None, 0.2]), mode=st.sampled_from(AGG_MODE_NAMES))
def test_value_loss_matches_loop_reference(case, clip, mode):
    vpreds, values, returns = case.randn(), case.randn(), case.randn()
    loss, metrics = value_loss(
        vpreds, values, returns, case.mask, cliprange_value=clip, agg=LossAggregation(mode)
    )
    losses = torch.zeros_like(vpreds)
    clipped_count = 0
    for i in range(case.batch):
        for t in range(case.length):
            v, old, r = float(vpreds[i, t]), float(values[i, t]), float(returns[i, t])
            a = (v - r) ** 2
            b = (min(max(v, old - clip), old + clip) - r) ** 2 if clip is not None else a
            losses[i, t] = max(a, b)
            clipped_count += int(b > a and case.mask[i, t] > 0)
    assert_close(loss, 0.5 * torch.as_tensor(loop_aggregate(losses, case.mask, mode)))
    n_tokens = int(case.mask.sum())
    assert abs(float(metrics["vf_clipfrac"]) - clipped_count / max(n_tokens, 1)) < 1e-12


def test_vf_clipfrac_counts_no_rounding_as_clipping():
    """verl's definition: inside the clip range the clipped prediction is vpreds itself.
    values + (vpreds - values) differs from vpreds by an ulp when values is much larger
    than vpreds, which counted ~6% of these tokens as clipped."""
    gen = torch.Generator().manual_seed(0)
    values = (torch.randn(64, 32, generator=gen) * 0.2).clamp(-0.45, 0.45)
    vpreds = torch.randn(64, 32, generator=gen) * 0.01  # |vpreds - values| < 0.5 everywhere
    returns = torch.randn(64, 32, generator=gen)
    mask = torch.ones(64, 32)
    loss, metrics = value_loss(vpreds, values, returns, mask, cliprange_value=0.5)
    assert float(metrics["vf_clipfrac"]) == 0.0
    assert float(loss) == pytest.approx(0.5 * float(((vpreds - returns) ** 2).mean()), rel=1e-6)
    far = values + torch.where(torch.arange(32) < 8, 0.9, 0.1)  # a quarter outside the range
    _, metrics = value_loss(far, values, returns, mask, cliprange_value=0.5)
    clipped = (far.clamp(values - 0.5, values + 0.5) - returns) ** 2 > (far - returns) ** 2
    assert float(metrics["vf_clipfrac"]) == pytest.approx(float(clipped.float().mean()))
    assert 0 < float(metrics["vf_clipfrac"]) <= 0.25


def test_value_loss_gradcheck():
    gen = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.float64)
    v = torch.randn(2, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    old, ret = (
        torch.randn(2, 4, generator=gen, dtype=torch.float64),
        torch.randn(2, 4, dtype=torch.float64, generator=gen),
    )
    assert torch.autograd.gradcheck(
        lambda x: value_loss(x, old, ret, mask, cliprange_value=0.3)[0], (v,)
    )


def test_dual_clip_caps_negative_advantage_loss():
    lp = torch.tensor([[5.0]], dtype=torch.float64, requires_grad=True)  # ratio e^5 >> c
    loss, metrics = ppo_policy_loss(
        lp,
        torch.zeros(1, 1, dtype=torch.float64),
        -torch.ones(1, 1, dtype=torch.float64),
        torch.ones(1, 1),
    )
    assert loss.item() == pytest.approx(3.0)  # -A * c with A = -1, c = 3
    assert float(metrics["pg_clipfrac_lower"]) == 1.0
    loss.backward()
    assert float(lp.grad) == 0.0  # the capped branch carries no gradient


def test_clip_higher_is_asymmetric():
    cfg = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28)
    mask, adv = torch.ones(1, 1), torch.ones(1, 1, dtype=torch.float64)
    old = torch.zeros(1, 1, dtype=torch.float64)
    for log_ratio, expected in [
        (math.log(1.25), -1.25),
        (math.log(1.5), -1.28),
        (math.log(0.5), -0.5),
    ]:
        lp = torch.full((1, 1), log_ratio, dtype=torch.float64)
        assert float(ppo_policy_loss(lp, old, adv, mask, config=cfg)[0]) == pytest.approx(expected)


@pytest.mark.parametrize("name", ["ppo", "gspo", "reinforce"])
@pytest.mark.parametrize("gap", [50.0, -50.0, 1000.0])
def test_no_nan_at_extreme_log_prob_gaps(name, gap):
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.float32)
    lp = torch.full((2, 4), -60.0 if gap < 0 else -1.0, requires_grad=True)
    old = lp.detach() - gap
    adv = torch.tensor([[1.0, -1.0, 2.0, float("nan")], [-3.0, 0.5, float("inf"), 0.0]])
    rollout = old + torch.where(mask.bool(), gap, float("nan"))
    weights, tis = truncated_is_weights(old, rollout, mask, cap=2.0)
    for agg in (LossAggregation(m) for m in AGG_MODE_NAMES):
        padded_nan = torch.where(mask.bool(), lp, torch.tensor(float("nan")))
        loss, metrics = POLICY_LOSSES.get(name)(
            padded_nan, old, adv, mask, agg=agg, is_weights=weights
        )
        (grad,) = torch.autograd.grad(loss, lp)
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
        assert all(torch.isfinite(v).all() for v in metrics.values())
    assert all(torch.isfinite(v) for v in tis.values())


@FAST
@given(
    case=cases(holes=True),
    cap=st.sampled_from([1.0, 2.0, 5.0]),
    level=st.sampled_from(["token", "sequence"]),
)
def test_truncated_is_weights_match_loop_reference(case, cap, level):
    old, rollout = case.randn(), case.randn()
    weights, metrics = truncated_is_weights(old, rollout, case.mask, cap=cap, level=level)
    capped = 0
    for i in range(case.batch):
        pos = [t for t in range(case.length) if case.mask[i, t] > 0]
        seq = math.exp(sum(float(old[i, t] - rollout[i, t]) for t in pos))
        for t in range(case.length):
            raw = math.exp(float(old[i, t] - rollout[i, t])) if level == "token" else seq
            expected = min(raw, cap) if t in pos else 0.0
            capped += int(t in pos and raw > cap)
            assert abs(float(weights[i, t]) - expected) < 1e-9 * max(1.0, expected)
    n_tokens = int(case.mask.sum())
    assert abs(float(metrics["tis_clipfrac"]) - capped / max(n_tokens, 1)) < 1e-12
    assert not weights.requires_grad


def test_is_weights_scale_the_per_token_loss():
    mask = torch.ones(1, 2, dtype=torch.float64)
    lp = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    adv = torch.ones(1, 2, dtype=torch.float64)
    weights = torch.tensor([[0.5, 2.0]], dtype=torch.float64)
    loss, _ = ppo_policy_loss(lp, lp.detach(), adv, mask, is_weights=weights)
    loss.backward()
    assert loss.item() == pytest.approx(-(0.5 + 2.0) / 2)
    assert lp.grad.tolist() == [[-0.25, -1.0]]


def test_bad_configs_say_what_to_do():
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        PolicyLossConfig(clip_ratio_c=0.9)
    with pytest.raises(
        LookupError, match="Did you mean 'ppo'.*actor_rollout_ref.actor.policy_loss"
    ):
        POLICY_LOSSES.get("pop")
    with pytest.raises(ValueError, match="level"):
        truncated_is_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), level="tok")
    assert POLICY_LOSSES.get("vanilla") is ppo_policy_loss
