"""GRPO steps on a tiny mixture of experts (Qwen3-MoE from `rayrl models tiny --family`)
on real Ray and a CPU, with routing replay: R3 (the native rollout records each token's
experts, both actor passes replay them) reports the routing metrics beside the
rollout-vs-actor probability gap, from the log-prob pass or, on-policy, from the
update's own forward; R2 (the log-prob pass records, the update replays) runs with the
hf rollout, which records nothing. A replay mode whose record did not
reach the update fails the step (`rayrl.workers.routing.update_pass`), so a step that
completes had it."""

from __future__ import annotations

import math

import pytest

from rayrl.config import load_config
from rayrl.models.tiny import build_tiny_model
from rayrl.trainer.ppo import PPOTrainer
from rayrl.trainer.run import Run

SMALL = [
    "data.train_batch_size=2",
    "data.max_response_length=8",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=1",  # two mini-batches: the log-prob pass runs
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "trainer.total_training_steps=2",
    "trainer.val_before_train=false",
    "trainer.device=cpu",
]


MODES = {
    "R3": [
        "actor_rollout_ref.rollout.name=native",
        "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
        "actor_rollout_ref.actor.router_replay.mode=R3",
    ],
    "R2": ["actor_rollout_ref.actor.router_replay.mode=R2"],  # rollout: hf on a CPU
    "R3-on-policy": [  # one mini-batch: the update's own forward counts (no log-prob pass)
        "actor_rollout_ref.rollout.name=native",
        "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
        "actor_rollout_ref.actor.router_replay.mode=R3",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    ],
}


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("moe") / "qwen3_moe", family="qwen3_moe")


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_grpo_steps_with_routing_replay_on_a_tiny_moe(ray_local, moe_model, tmp_path, mode):
    cfg = load_config(
        "grpo",
        [
            *SMALL,
            *MODES[mode],
            f"actor_rollout_ref.model.path={moe_model}",
            f"trainer.output_dir={tmp_path}",
        ],
    )
    run = Run(PPOTrainer(cfg))
    try:
        history = run.setup().fit()
    finally:
        run.shutdown()
    assert len(history) == 2
    for metrics in history:
        assert math.isfinite(metrics["actor/pg_loss"])
        assert (metrics["timing_s/old_log_prob"] == 0) == (mode == "R3-on-policy")
        if mode == "R2":  # no rollout record to compare with
            assert not [key for key in metrics if "routing" in key or "router" in key]
            continue
        # the log-prob pass replayed the rollout's record at every position it covers
        assert metrics["actor/routing_mismatch_frac"] == 0.0
        assert metrics["actor/routing_recorded_frac"] == 1.0
        assert 0.0 <= metrics["actor/router_disagree_frac"] <= 1.0
        assert metrics["training/rollout_probs_diff_max"] < 1e-3  # fp32 on both sides
