"""GPG, the optimal token baseline, GMPO, CISPO, SAPO, GPG's loss and PF-PPO against verl
0.9.1's own functions (`verl_core_algos`: read from verl's wheel and executed) on the same
random inputs: several shapes, ragged and holey masks with finite garbage in the padding,
prompt groups of different sizes, float32 and float64. Values, metrics and gradients
agree to 1e-6.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from algos_testlib import AGG_MODE_NAMES
from verl_core_algos import ActorConfig, DataProto, load_verl

from rayrl.algos import (
    LossAggregation,
    PolicyLossConfig,
    cispo_policy_loss,
    geo_mean_policy_loss,
    gpg_advantages,
    optimal_token_baseline_advantages,
    pf_ppo_resample,
    reinforce_policy_loss,
    sapo_policy_loss,
)
from rayrl.algos.variance_proxy import variance_proxy_metrics

TOL = 1e-6
VERL = load_verl()
pytestmark = pytest.mark.skipif(
    VERL is None, reason="verl 0.9.1's wheel could not be downloaded (pip download verl==0.9.1)"
)
SHAPES = [(1, 1), (3, 5), (8, 9), (16, 13), (33, 32)]
SEEDS = [0, 1, 2]
DTYPES = [torch.float32, torch.float64]
CLIPS = [(0.2, 0.2), (0.2, 0.28), (0.1, 0.4)]
LOSSES = {
    "geo_mean": geo_mean_policy_loss,
    "cispo": cispo_policy_loss,
    "sapo": sapo_policy_loss,
    "gpg": reinforce_policy_loss,
}


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def inputs(shape, seed, dtype, holes=False, min_len=1, groups=None, sparse=True):
    """Random masked batch: scores on the last real token (zero for about a third of the
    responses when ``sparse``), log-probs, garbage (finite) in the padding."""
    batch, length = shape
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, length + 1, (batch,), generator=g)
    mask = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    if holes:
        mask &= torch.rand(batch, length, generator=g) > 0.3
        mask[:, 0] |= lengths > 0  # holes inside, but a response keeps its first token
    mask = mask.to(dtype)
    scores = torch.randn(batch, generator=g, dtype=torch.float64)
    if sparse:
        scores = torch.where(torch.rand(batch, generator=g) < 0.35, 0.0, scores)
    rewards = torch.zeros(batch, length, dtype=torch.float64)
    last = (lengths - 1).clamp(min=0)
    rewards[torch.arange(batch), last] = scores
    old = -torch.rand(batch, length, generator=g, dtype=torch.float64) * 4
    lp = old + 0.4 * torch.randn(batch, length, generator=g, dtype=torch.float64)
    num_groups = groups or max(1, batch // 3)
    ids = torch.randint(0, num_groups, (batch,), generator=g)
    index = np.array([f"prompt-{int(i)}" for i in ids], dtype=object)
    seq_adv = torch.randn(batch, 1, generator=g, dtype=torch.float64)
    token_adv = torch.randn(batch, length, generator=g, dtype=torch.float64)
    spi = torch.rand(batch, length, generator=g, dtype=torch.float64) * 0.9
    is_w = torch.rand(batch, length, generator=g, dtype=torch.float64) * 1.5 + 0.2
    cast = {
        "rewards": rewards,
        "old": old,
        "lp": lp,
        "seq_adv": seq_adv.expand(batch, length).contiguous(),
        "token_adv": token_adv,
        "spi": spi,
        "is_w": is_w,
    }
    out = {k: v.to(dtype) for k, v in cast.items()}
    out.update(mask=mask, index=index)
    return out


# --------------------------------------------------------------------- advantages


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpg_advantages_match_verl(shape, seed, dtype):
    x = inputs(shape, seed, dtype, holes=seed == 2, min_len=0)
    want, want_ret = VERL.compute_gpg_outcome_advantage(x["rewards"].clone(), x["mask"], x["index"])
    got, got_ret = gpg_advantages(x["rewards"], x["mask"], x["index"])
    assert max_diff(got, want) <= TOL and max_diff(got_ret, want_ret) <= TOL


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("handle_zero_tail", [True, False])
@pytest.mark.parametrize("with_is", [False, True])
def test_optimal_token_baseline_matches_verl(shape, seed, handle_zero_tail, with_is):
    dtype = torch.float64 if seed else torch.float32
    x = inputs(shape, seed, dtype, holes=seed == 2, min_len=0, groups=max(1, shape[0] // 4))
    w = x["is_w"] * x["mask"] if with_is else None
    args = (x["rewards"], x["mask"], x["index"], x["old"], x["spi"], w)
    want, want_ret = VERL.compute_optimal_token_baseline_advantage(
        *args, handle_zero_tail=handle_zero_tail
    )
    got, got_ret = optimal_token_baseline_advantages(*args, handle_zero_tail=handle_zero_tail)
    assert max_diff(got, want) <= TOL
    # verl leaves the reward-to-go on masked positions inside a response; rayrl zeroes them
    assert max_diff(got_ret, want_ret * x["mask"]) <= TOL


@pytest.mark.parametrize("shape", SHAPES[1:])
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("with_is", [False, True])
@pytest.mark.parametrize("grad_norm", [None, 0.3])
def test_variance_proxy_metrics_match_verl(shape, seed, with_is, grad_norm):
    x = inputs(shape, seed, torch.float64, holes=seed == 2, min_len=1)
    adv = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    columns = {
        "old_log_probs": x["old"],
        "sum_pi_squared": x["spi"],
        "advantages": adv,
        "response_mask": x["mask"],
    }
    if with_is:
        columns["rollout_is_weights"] = x["is_w"]
    want = VERL.compute_variance_proxy_metrics(DataProto(columns, {}), gradient_norm=grad_norm)
    got = variance_proxy_metrics(
        x["old"],
        x["spi"],
        adv,
        x["mask"],
        rollout_is_weights=columns.get("rollout_is_weights"),
        grad_norm=grad_norm,
    )
    assert got.keys() == want.keys()
    for key, value in want.items():
        # verl divides a masked mean by count + 1e-8, rayrl by the count
        assert got[key] == pytest.approx(float(value), rel=1e-7, abs=1e-12), key


def test_optimal_token_baseline_zero_tail_case_is_exercised():
    """A group whose longest response is unique: the parity above covers the zero tail."""
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]], dtype=torch.float64)
    rewards = torch.zeros(3, 5, dtype=torch.float64)
    rewards[0, 4], rewards[1, 1], rewards[2, 2] = 1.0, 0.0, 1.0
    index = np.array(["a", "a", "a"], dtype=object)
    old = torch.full((3, 5), -1.0, dtype=torch.float64)
    spi = torch.full((3, 5), 0.3, dtype=torch.float64)
    got = {}
    for tail in (True, False):
        want, _ = VERL.compute_optimal_token_baseline_advantage(
            rewards, mask, index, old, spi, handle_zero_tail=tail
        )
        got[tail], _ = optimal_token_baseline_advantages(
            rewards, mask, index, old, spi, handle_zero_tail=tail
        )
        assert max_diff(got[tail], want) <= TOL
    # past the second-longest length (3), row 0 alone has data: with the tail handled it
    # keeps its return (1) as advantage, without, its own return is its baseline (~0)
    assert torch.allclose(got[True][0, 3:], torch.ones(2, dtype=torch.float64))
    assert got[False][0, 3:].abs().max() < 1e-6


# ------------------------------------------------------------------- policy losses


def _both(name, x, adv, mode, clip, with_is):
    """(verl's loss, metrics, grad) and rayrl's, on the same inputs."""
    low, high = clip
    w = x["is_w"] if with_is else None
    lp_v = x["lp"].clone().requires_grad_(True)
    verl_fn = getattr(VERL, f"compute_policy_loss_{name}")
    cfg_v = ActorConfig(clip_ratio_low=low, clip_ratio_high=high, tau_pos=1.0, tau_neg=1.05)
    loss_v, metrics_v = verl_fn(x["old"], lp_v, adv, x["mask"], mode, cfg_v, w)
    (grad_v,) = torch.autograd.grad(loss_v, lp_v)
    lp_r = x["lp"].clone().requires_grad_(True)
    cfg_r = PolicyLossConfig(clip_ratio_low=low, clip_ratio_high=high)
    loss_r, metrics_r = LOSSES[name](
        lp_r, x["old"], adv, x["mask"], config=cfg_r, agg=LossAggregation(mode), is_weights=w
    )
    (grad_r,) = torch.autograd.grad(loss_r, lp_r)
    return (loss_v, metrics_v, grad_v), (loss_r, metrics_r, grad_r)


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("shape", SHAPES[1:])
@pytest.mark.parametrize("mode", AGG_MODE_NAMES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_policy_losses_match_verl(name, shape, mode, dtype):
    for seed, clip in zip(SEEDS, CLIPS, strict=True):
        x = inputs(shape, seed, dtype, holes=seed == 2)
        for adv_key, with_is in (("seq_adv", False), ("token_adv", True)):
            if name == "geo_mean" and adv_key == "token_adv":
                adv_key = "seq_adv"  # GMPO (verl too) is defined for response-level advantages
            adv = x[adv_key] * x["mask"]
            verl, ours = _both(name, x, adv, mode, clip, with_is)
            assert abs(float(verl[0].detach()) - float(ours[0].detach())) <= TOL, (name, mode, seed)
            assert max_diff(ours[2], verl[2] * x["mask"]) <= TOL, (name, mode, seed)
            for key, value in verl[1].items():
                assert abs(value - float(ours[1][key.removeprefix("actor/")])) <= TOL, key


# ------------------------------------------------------------------------- PF-PPO


@pytest.mark.parametrize("method", ["pow", "max_min", "max_random"])
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("weight_pow", [1.0, 2.0, 3.5])
def test_pf_ppo_draws_the_rows_verl_draws(method, seed, weight_pow):
    """Same generator state, same rows: verl's global RNG seeded as rayrl's generator."""
    g = torch.Generator().manual_seed(seed)
    n = 4 + 5 * seed
    token_scores = torch.randn(n, 6, generator=g)
    if seed == 1:
        token_scores[::3] = 0.0  # ties at the max and min, zero weights
    data = DataProto(
        {"token_level_scores": token_scores, "row": torch.arange(n)},
        {"uid": np.array([f"u{i}" for i in range(n)], dtype=object)},
    )
    torch.manual_seed(1000 + seed)
    verl_rows = VERL.compute_pf_ppo_reweight_data(data, method, weight_pow).batch["row"]
    rows = pf_ppo_resample(
        token_scores.sum(-1),
        method,
        weight_pow,
        generator=torch.Generator().manual_seed(1000 + seed),
    )
    assert torch.equal(rows, verl_rows)
