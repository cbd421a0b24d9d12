"""Rollout rejection sampling (`rayrl.algos.rejection`) against verl 0.9.1's own
``compute_rollout_rejection_mask`` (read from verl's wheel by `verl_core_algos` and
executed) on the same random log-ratios: every option alone, options chained with one
shared threshold or one per option, k1 bounds given as lower_upper or as one number,
ragged and holey masks (an empty response included) with garbage in the padding,
float32 and float64. Masks are equal; metrics have the same names and agree to 1e-6
(relative for the large k3 values). Specs verl refuses, rayrl refuses too."""

from __future__ import annotations

import math

import pytest
import torch
from verl_core_algos import load_verl

from rayrl.algos.rejection import REJECTION_OPTIONS, parse_rejection, rejection_mask

VERL = load_verl()
pytestmark = pytest.mark.skipif(
    VERL is None, reason="verl 0.9.1's wheel could not be downloaded (pip download verl==0.9.1)"
)
SHAPES = [(1, 1), (3, 5), (8, 9), (16, 13)]
SEEDS = [0, 1, 2]
DTYPES = [torch.float32, torch.float64]

# Thresholds that keep some tokens and reject others on `inputs`' log-ratios.
K1_SPECS = ["0.8_1.25", 1.3, "1.5", "0.5_3.0", "1.0_1.2"]
OTHER_SPECS = [0.02, "0.1", 1, "0.35"]
CHAINS = [
    ("token_k1,seq_max_k3", "0.4_1.8,3.0"),
    ("seq_mean_k1,seq_max_k3", "0.8_1.2,3.0"),
    ("token_k2,seq_mean_k3,seq_max_k2", 0.05),
    ("seq_sum_k1,token_k3,seq_sum_k2", "0.6_1.7, 0.04 ,0.8"),
    (" token_k1 , seq_sum_k2 ", "0.7_1.4,0.5"),
    ("token_k1,seq_sum_k3", 1.5),  # one number for both: k1's bounds are 1/1.5 and 1.5
    ("token_k2,token_k2,seq_mean_k1", "0.03,0.9_1.1"),  # a repeat is dropped first
]


def inputs(shape, seed, dtype, mask_dtype=torch.float32):
    """Log-ratios mostly small, some large (a few beyond the +-20 clamp), a ragged mask
    with holes (row 0 empty when there are several rows), big finite garbage in padding."""
    batch, length = shape
    g = torch.Generator().manual_seed(seed)
    log_ratio = 0.3 * torch.randn(batch, length, generator=g, dtype=torch.float64)
    spikes = torch.rand(batch, length, generator=g) < 0.1
    log_ratio = torch.where(spikes, 8 * torch.randn(batch, length, generator=g).double(), log_ratio)
    log_ratio[torch.rand(batch, length, generator=g) < 0.03] = 25.0
    lengths = torch.randint(1, length + 1, (batch,), generator=g)
    mask = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    if seed == 2:
        mask &= torch.rand(batch, length, generator=g) > 0.3
        mask[:, 0] = True
    if batch > 1:
        mask[0] = False
    log_ratio = torch.where(mask, log_ratio, torch.full_like(log_ratio, 1e3))
    return log_ratio.to(dtype), mask.to(mask_dtype)


def assert_same(log_ratio, mask, rollout_rs, threshold):
    want_mask, want = VERL.compute_rollout_rejection_mask(log_ratio, mask, rollout_rs, threshold)
    got_mask, got = rejection_mask(log_ratio, mask, parse_rejection(rollout_rs, threshold))
    assert got_mask.dtype == want_mask.dtype and torch.equal(got_mask, want_mask)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert math.isclose(got[key], value, rel_tol=1e-6, abs_tol=1e-6), (key, got[key], value)
    return want


def _specs(option: str) -> list:
    return K1_SPECS if option.endswith("k1") else OTHER_SPECS


@pytest.mark.parametrize("option", REJECTION_OPTIONS.names())
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_option_matches_verl(option, shape, seed, dtype):
    log_ratio, mask = inputs(shape, seed, dtype)
    for spec in _specs(option):
        assert_same(log_ratio, mask, option, spec)


def test_the_options_are_verls():
    assert set(REJECTION_OPTIONS.names()) == VERL.SUPPORTED_ROLLOUT_RS_OPTIONS


def test_the_cases_reject_some_tokens_and_keep_others():
    """The thresholds above do exercise both sides of every option's bounds."""
    log_ratio, mask = inputs((16, 13), 0, torch.float64)
    for option in REJECTION_OPTIONS.names():
        fractions = [
            VERL.compute_rollout_rejection_mask(log_ratio, mask, option, spec)[1][
                "rollout_rs_masked_fraction"
            ]
            for spec in _specs(option)
        ]
        assert any(0 < f < 1 for f in fractions), (option, fractions)


@pytest.mark.parametrize("rollout_rs, threshold", CHAINS)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.int64, torch.bool])
def test_chained_options_match_verl(rollout_rs, threshold, seed, mask_dtype):
    log_ratio, mask = inputs((12, 11), seed, torch.float32, mask_dtype)
    want = assert_same(log_ratio, mask, rollout_rs, threshold)
    assert 0 < want["rollout_rs_masked_fraction"] < 1


def test_an_empty_batch_comes_back_as_it_is():
    log_ratio, mask = torch.zeros(0, 4), torch.zeros(0, 4)
    assert_same(log_ratio, mask, "token_k1", 2.0)


@pytest.mark.parametrize(
    "rollout_rs, threshold",
    [
        ("token_k4", 2.0),
        ("seq_max_k1", 2.0),
        ("", 2.0),
        (" , ", 2.0),
        ("token_k1", None),
        ("token_k1,seq_max_k3", "0.5_2.0,1.0,2.0"),
        ("token_k1,token_k1", "1.5,2.0"),
        ("token_k2", "0.1_0.2"),
        ("token_k1", "2.0_1.0"),
        ("token_k1", 0.5),
        ("token_k1", "0_2"),
        ("seq_mean_k3", "-1"),
        ("seq_mean_k3", 0),
        ("token_k2", "abc"),
        ("token_k1", "0.5_x"),
        ("token_k2", ""),
    ],
)
def test_what_verl_refuses_is_refused(rollout_rs, threshold):
    log_ratio, mask = inputs((3, 5), 0, torch.float32)
    with pytest.raises(ValueError):
        VERL.compute_rollout_rejection_mask(log_ratio, mask, rollout_rs, threshold)
    with pytest.raises(ValueError, match="algorithm.rollout_correction.rollout_rs"):
        parse_rejection(rollout_rs, threshold)
