"""Rollout rejection sampling through the product (verl's
`algorithm.rollout_correction.rollout_rs` / `rollout_rs_threshold`): a verl command line
loads with `rayrl config show`, bad values are refused naming the key and what to do;
the advantage stage takes the rejected tokens out of `response_mask` before the
advantages (importance weights and their normaliser over the mask before it, as
verl's); in bypass mode the actor's loss rejects against the current policy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from algos_testlib import config_show

from rayrl.algos import (
    POLICY_LOSSES,
    LossAggregation,
    is_batch_norm_factor,
    parse_rejection,
    rejection_mask,
    truncated_is_weights,
)
from rayrl.batch import Batch
from rayrl.config import load_config
from rayrl.trainer.advantage import AdvantageStage
from rayrl.trainer.on_policy import separate_pass_reason
from rayrl.workers.actor import update_actor_reads
from rayrl.workers.losses import actor_loss_fn

RC = "algorithm.rollout_correction"
ACTOR = "actor_rollout_ref.actor"
SMALL = [
    "data.train_batch_size=2",
    "data.max_response_length=6",
    f"{ACTOR}.ppo_mini_batch_size=2",
    f"{ACTOR}.ppo_micro_batch_size_per_gpu=1",
    f"{ACTOR}.use_kl_loss=false",
]


# ------------------------------------------------------------------- the keys


@pytest.mark.parametrize(
    "rs, threshold, shown",
    [
        ("token_k1", "0.5_2.0", "0.5_2.0"),
        ("token_k1,seq_max_k3", "0.4_1.8,3.0", "0.4_1.8,3.0"),
        ("'seq_mean_k1,seq_max_k3'", "'0.8_1.2,3.0'", "0.8_1.2,3.0"),  # Hydra's quoting
        ("seq_sum_k3", "2", "2"),
        ("token_k2", "0.05", "0.05"),
    ],
)
def test_verl_command_lines_load(capsys, rs, threshold, shown):
    code, out, err = config_show(
        capsys, "grpo", f"{RC}.rollout_rs={rs}", f"{RC}.rollout_rs_threshold={threshold}"
    )
    assert code == 0, err
    assert f"rollout_rs: {rs.strip(chr(39))}\n" in out
    assert f"rollout_rs_threshold: {shown}\n" in out
    assert "rejection" not in err  # no longer refused, no warning either


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            [f"{RC}.rollout_rs=token_k4", f"{RC}.rollout_rs_threshold=2.0"],
            "rollout_rs='token_k4': unknown rollout rejection option 'token_k4'. Did you mean",
        ),
        (
            [f"{RC}.rollout_rs=seq_max_k1", f"{RC}.rollout_rs_threshold=2.0"],
            "Valid names: seq_max_k2, seq_max_k3, seq_mean_k1",
        ),
        ([f"{RC}.rollout_rs=token_k1"], f"token_k1 needs {RC}.rollout_rs_threshold: give one"),
        (
            [f"{RC}.rollout_rs=token_k1,seq_max_k3", f"{RC}.rollout_rs_threshold=0.5_2.0,1.0,2.0"],
            "gives 3 thresholds for the 2 options of rollout_rs (token_k1, seq_max_k3)",
        ),
        (
            [f"{RC}.rollout_rs=seq_mean_k3", f"{RC}.rollout_rs_threshold=0.5_2.0"],
            "option seq_mean_k3 takes one upper bound, not '0.5_2.0'",
        ),
        (
            [f"{RC}.rollout_rs=token_k1", f"{RC}.rollout_rs_threshold=2.0_1.0"],
            "lower bound 2 above its upper bound 1",
        ),
        (
            [f"{RC}.rollout_rs=token_k2", f"{RC}.rollout_rs_threshold=abc"],
            "of option token_k2 must be a positive number (got 'abc')",
        ),
        (
            [
                f"{RC}.rollout_rs=token_k2",
                f"{RC}.rollout_rs_threshold=0.1",
                "actor_rollout_ref.rollout.calculate_log_probs=false",
            ],
            "calculate_log_probs=false drops; set it to true",
        ),
    ],
)
def test_bad_values_are_refused_naming_the_key(capsys, overrides, message):
    code, _, err = config_show(capsys, "grpo", *overrides)
    assert code == 2
    assert message in " ".join(err.split())
    assert f"{RC}.rollout_rs" in err


def test_a_threshold_without_rejection_warns():
    seen: list[str] = []
    load_config("grpo", [f"{RC}.rollout_rs_threshold=2.0"], warn=seen.append)
    assert any("rollout_rs_threshold=2.0 has no effect" in line for line in seen)


def test_rejection_needs_the_old_log_probs_and_sends_the_mask_before_it():
    cfg = load_config("grpo", [*SMALL, f"{RC}.rollout_rs=token_k2", f"{RC}.rollout_rs_threshold=1"])
    assert (
        separate_pass_reason(cfg, 4)
        == "rollout rejection sampling compares them with the rollout's"
    )
    assert "rollout_is_mask" not in update_actor_reads(cfg)
    cfg.algorithm.rollout_correction.rollout_is = "token"
    assert "rollout_is_mask" in update_actor_reads(cfg)


# ------------------------------------------------------ the advantage stage


def _batch(seed: int = 0) -> Batch:
    """8 samples in 4 prompt groups, ragged responses, rollout log-probs some way from
    the old ones (a few far)."""
    g = torch.Generator().manual_seed(seed)
    n, width = 8, 6
    lengths = torch.tensor([6, 3, 5, 1, 6, 4, 2, 6])
    mask = (torch.arange(width)[None] < lengths[:, None]).long()
    scores = torch.randn(n, generator=g)
    token_scores = torch.zeros(n, width)
    token_scores[torch.arange(n), lengths - 1] = scores
    old = -torch.rand(n, width, generator=g) * 3
    rollout = old + 0.3 * torch.randn(n, width, generator=g)
    rollout[torch.rand(n, width, generator=g) < 0.15] -= 2.0
    uid = np.array([f"p{i // 2}" for i in range(n)], dtype=object)
    tensors = {
        "response_mask": mask,
        "token_level_scores": token_scores,
        "scores": scores,
        "old_log_probs": old,
        "rollout_log_probs": rollout,
    }
    return Batch(tensors, {"uid": uid}, {"step": 1})


def test_the_stage_masks_the_rejected_tokens_before_the_advantages():
    overrides = [f"{RC}.rollout_rs=token_k1,seq_max_k2", f"{RC}.rollout_rs_threshold=0.7_1.5,0.9"]
    cfg = load_config("grpo", [*SMALL, *overrides])
    batch = _batch()
    before = batch["response_mask"].clone()
    metrics = AdvantageStage(cfg)(batch)
    rules = parse_rejection("token_k1,seq_max_k2", "0.7_1.5,0.9")
    log_ratio = batch["old_log_probs"] - batch["rollout_log_probs"]
    want_mask, want = rejection_mask(log_ratio, before, rules)
    assert torch.equal(batch["response_mask"], want_mask)
    assert batch["response_mask"].dtype == before.dtype
    assert 0 < want["rollout_rs_masked_fraction"] < 1
    assert {k: metrics[f"rollout_corr/{k}"] for k in want} == want
    rejected = before.bool() & ~want_mask.bool()
    assert batch["advantages"][rejected].abs().sum() == 0  # no advantage on them
    assert batch["advantages"][want_mask.bool()].abs().sum() > 0
    assert "rollout_is_mask" not in batch  # no importance weights to compute over it


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_importance_weights_use_the_mask_before_rejection(level):
    """verl computes the weights (and their batch mean) over the response mask before
    rejection: the sequence weight of a partly rejected response counts all its tokens."""
    overrides = [
        f"{RC}.rollout_rs=token_k1",
        f"{RC}.rollout_rs_threshold=0.7_1.5",
        f"{RC}.rollout_is={level}",
        f"{RC}.rollout_is_batch_normalize=true",
    ]
    cfg = load_config("grpo", [*SMALL, *overrides])
    batch = _batch(1)
    before = batch["response_mask"].clone()
    metrics = AdvantageStage(cfg)(batch)
    assert torch.equal(batch["rollout_is_mask"], before)
    assert not torch.equal(batch["response_mask"], before)
    old, rollout = batch["old_log_probs"], batch["rollout_log_probs"]
    weights, _ = truncated_is_weights(old, rollout, before, cap=2.0, level=level)
    factor = is_batch_norm_factor(weights, before, level)
    assert metrics["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(factor)
    loss_fn = actor_loss_fn(
        cfg.actor_rollout_ref.actor, correction=cfg.algorithm.rollout_correction
    )
    log_probs = old + 0.05
    loss, _ = loss_fn({"log_probs": log_probs}, batch)
    args = (log_probs, old, batch["advantages"], batch["response_mask"])
    want, _ = POLICY_LOSSES.get("vanilla")(
        *args, agg=LossAggregation("token-mean"), is_weights=weights / factor
    )
    assert float(loss) == pytest.approx(float(want), rel=1e-6)


# ------------------------------------------------------------- bypass mode


def _bypass_cfg(threshold: str):
    overrides = [
        f"{RC}.bypass_mode=true",
        f"{RC}.rollout_rs=token_k2",
        f"{RC}.rollout_rs_threshold={threshold}",
    ]
    return load_config("grpo", [*SMALL, *overrides])


def test_bypass_mode_rejects_in_the_loss_against_the_current_policy():
    cfg = _bypass_cfg("0.05")
    batch = _batch(2)
    batch["old_log_probs"] = batch["rollout_log_probs"].clone()  # what the trainer sets
    stage_mask = batch["response_mask"].clone()
    AdvantageStage(cfg)(batch)
    assert torch.equal(batch["response_mask"], stage_mask)  # the stage leaves it alone
    mask, tokens = batch["response_mask"], float(batch["response_mask"].sum())
    batch.meta.update(global_token_count=tokens, global_seq_count=float(len(batch)))
    noise = 0.4 * torch.randn(8, 6, generator=torch.Generator().manual_seed(5))
    log_probs = (batch["rollout_log_probs"] + noise).requires_grad_()
    loss_fn = actor_loss_fn(
        cfg.actor_rollout_ref.actor, correction=cfg.algorithm.rollout_correction
    )
    loss, metrics = loss_fn({"log_probs": log_probs}, batch)
    rules = parse_rejection("token_k2", "0.05")
    kept, found = rejection_mask(log_probs.detach() - batch["rollout_log_probs"], mask, rules)
    assert 0 < found["rollout_rs_masked_fraction"] < 1
    for key in ("rollout_rs_masked_fraction", "rollout_rs_seq_masked_fraction"):
        assert metrics[f"rollout_corr/{key}"] == pytest.approx(found[key])
    args = (log_probs, batch["old_log_probs"], batch["advantages"])
    agg = LossAggregation("token-mean", global_token_count=tokens)  # verl: the batch's count
    want, _ = POLICY_LOSSES.get("vanilla")(*args, kept, agg=agg)
    assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-6)
    (grad,) = torch.autograd.grad(loss, log_probs)
    assert grad[mask.bool() & ~kept.bool()].abs().sum() == 0  # rejected: no gradient
    assert grad[kept.bool()].abs().sum() > 0


def test_bypass_mode_rejecting_everything_leaves_no_gradient():
    cfg = _bypass_cfg("1e-9")
    batch = _batch(3)
    batch["old_log_probs"] = batch["rollout_log_probs"].clone()
    AdvantageStage(cfg)(batch)
    noise = 0.4 * torch.randn(8, 6, generator=torch.Generator().manual_seed(5))
    log_probs = (batch["rollout_log_probs"] + noise).requires_grad_()
    loss_fn = actor_loss_fn(
        cfg.actor_rollout_ref.actor, correction=cfg.algorithm.rollout_correction
    )
    loss, metrics = loss_fn({"log_probs": log_probs}, batch)
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == 1.0
    (grad,) = torch.autograd.grad(loss, log_probs)
    assert float(loss.detach()) == 0.0 and grad.abs().sum() == 0
