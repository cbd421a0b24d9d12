"""GRPO steps on a tiny mixture of experts (Qwen3-MoE from `rayrl models tiny --family`)
on real Ray and a CPU, the native rollout recording each token's experts: with R3 both
actor passes replay the record, with R2 the log-prob pass records the actor's routing
(compared with the rollout's) and the update replays it. Each reports the routing
metrics beside the rollout-vs-actor probability gap. A replay mode whose record did not
reach the update fails the step (`rayrl.workers.routing.update_pass`), so a step that
completes had it. (An on-policy update's own counts: `test_router_replay`.)"""

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
    "trainer.total_training_steps=1",
    "trainer.val_before_train=false",
    "trainer.device=cpu",
]


NATIVE_RECORD = [
    "actor_rollout_ref.rollout.name=native",
    "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
]
MODES = {
    "R3": [*NATIVE_RECORD, "actor_rollout_ref.actor.router_replay.mode=R3"],
    "R2": [*NATIVE_RECORD, "actor_rollout_ref.actor.router_replay.mode=R2"],
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
    assert len(history) == 1
    for metrics in history:
        assert math.isfinite(metrics["actor/pg_loss"]) and metrics["timing_s/old_log_prob"] > 0
        # R3's log-prob pass replays the rollout's record; R2's routes on its own, and on
        # fp32 on both sides its routing is the rollout's too
        assert metrics["actor/routing_mismatch_frac"] == 0.0
        assert metrics["actor/routing_recorded_frac"] == 1.0
        assert 0.0 <= metrics["actor/router_disagree_frac"] <= 1.0
        assert metrics["training/rollout_probs_diff_max"] < 1e-3
