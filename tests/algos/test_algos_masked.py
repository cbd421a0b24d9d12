"""Masked reductions, group statistics and the name registry."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from algos_testlib import FAST, assert_close, cases, loop_whiten
from hypothesis import given

from rayrl.algos import (
    ADV_ESTIMATORS,
    AGG_MODES,
    KL_ESTIMATORS,
    PF_PPO_WEIGHTS,
    POLICY_LOSSES,
    Registry,
    UnknownNameError,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from rayrl.algos.groups import group_ids, group_stats


@FAST
@given(case=cases(holes=True))
def test_masked_reductions_match_loops_and_ignore_nan_padding(case):
    values = case.randn()
    garbage = torch.where(case.mask.bool(), values, torch.tensor(float("nan")))
    picked = [
        float(values[i, t])
        for i in range(case.batch)
        for t in range(case.length)
        if case.mask[i, t]
    ]
    n = len(picked)
    mean = sum(picked) / n if n else 0.0
    var = sum((x - mean) ** 2 for x in picked) / (n - 1) if n > 1 else 0.0
    assert float(masked_sum(garbage, case.mask)) == pytest.approx(sum(picked), abs=1e-9)
    assert float(masked_mean(garbage, case.mask)) == pytest.approx(mean, abs=1e-9)
    assert float(masked_var(garbage, case.mask)) == pytest.approx(var, abs=1e-9)
    assert_close(masked_whiten(garbage, case.mask), loop_whiten(values, case.mask), atol=1e-6)
    rows = masked_mean(garbage, case.mask, dim=-1)
    for i in range(case.batch):
        row = [float(values[i, t]) for t in range(case.length) if case.mask[i, t]]
        assert float(rows[i]) == pytest.approx(sum(row) / len(row) if row else 0.0, abs=1e-9)


def test_whiten_without_shift_keeps_the_mean():
    values = torch.tensor([[1.0, 2.0, 3.0, 100.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]])
    out = masked_whiten(values, mask, shift_mean=False)
    assert float(masked_mean(out, mask)) == pytest.approx(2.0)
    assert float(masked_var(out, mask)) == pytest.approx(1.0, rel=1e-6)
    assert float(out[0, 3]) == 0.0


def test_group_stats_by_uid():
    scores = torch.tensor([1.0, 2.0, 3.0, 10.0], dtype=torch.float64)
    stats = group_stats(scores, np.array(["b", "a", "b", "c"], dtype=object))
    assert stats.size.tolist() == [2, 1, 2, 1]
    assert stats.mean.tolist() == [2.0, 2.0, 2.0, 10.0]
    assert stats.std.tolist() == pytest.approx(
        [math.sqrt(2.0), 0.0, math.sqrt(2.0), 0.0], rel=1e-15
    )
    assert stats.total.tolist() == [4.0, 2.0, 4.0, 10.0]
    ids, count = group_ids(["x", "y", "x"])
    assert ids.tolist() == [0, 1, 0] and count == 2
    with pytest.raises(ValueError, match="one prompt uid per response"):
        group_stats(scores, ["a", "b"])


def test_registry_register_get_alias_and_errors():
    reg: Registry = Registry("widget", config_key="things.widget")

    @reg.register("round", aliases=("circle",), sides=0)
    def round_widget():
        return "round"

    reg.add("square", lambda: "square", sides=4)
    assert reg.get("circle") is round_widget
    assert reg.names() == ["round", "square"] and len(reg) == 2 and "circle" in reg
    assert reg.info("circle") == {"sides": 0}
    with pytest.raises(ValueError, match="already registered"):
        reg.add("circle", round_widget)
    with pytest.raises(UnknownNameError) as err:
        reg.get("sqaure")
    message = str(err.value)
    assert "unknown widget 'sqaure'" in message
    assert "Did you mean 'square'?" in message
    assert "Valid names: circle, round, square" in message
    assert "Set things.widget" in message
    assert "Did you mean" not in str(pytest.raises(UnknownNameError, reg.get, "zzz").value)


def test_built_in_registries_hold_the_documented_names():
    assert set(ADV_ESTIMATORS.names()) == {
        "gae",
        "grpo",
        "dr_grpo",
        "rloo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "remax",
        "gpg",
        "optimal_token_baseline",
    }
    assert set(POLICY_LOSSES.names()) == {
        "ppo",
        "gspo",
        "reinforce",
        "geo_mean",
        "cispo",
        "sapo",
    }
    assert POLICY_LOSSES.canonical("gpg") == "reinforce"
    assert PF_PPO_WEIGHTS.names() == ["pow", "max_min", "max_random"]
    assert AGG_MODES.names() == [
        "token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
    ]
    assert set(KL_ESTIMATORS.names()) == {"k1", "k1+", "abs", "abs+", "k2", "k2+", "k3", "k3+"}
