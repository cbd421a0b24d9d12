"""Rollout rejection sampling in a real GRPO run on a local Ray (tiny model, CPU): with a
token_k1 window that leaves out ratio 1 (the rollout and the trainer agree on a CPU) the
run logs verl's `rollout_corr/rollout_rs_masked_fraction` at 1 and the actor's update
gets no gradient at all, though the entropy bonus would give one on any token left.
An asynchronous run (`rollout.mode=async`) takes the same step code after its queue."""

from __future__ import annotations

import pytest

from rayrl.config import load_config
from rayrl.trainer.ppo import PPOTrainer
from rayrl.trainer.run import Run

RC = "algorithm.rollout_correction"
SMALL = [
    "data.train_batch_size=2",
    "data.max_response_length=8",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.actor.entropy_coeff=0.01",
    "trainer.total_training_steps=1",
    "trainer.device=cpu",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "trainer.save_freq=-1",
    "trainer.export_hf=false",
]


def _fit(overrides: list[str]) -> dict:
    run = Run(PPOTrainer(load_config("grpo", [*SMALL, *overrides])))
    try:
        (metrics,) = run.setup().fit()
    finally:
        run.shutdown()
    return metrics


@pytest.mark.slow
def test_rejected_tokens_give_no_gradient_in_a_grpo_run(ray_local, tmp_path):
    metrics = _fit(
        [
            f"trainer.output_dir={tmp_path}",
            f"{RC}.rollout_rs=token_k1",
            f"{RC}.rollout_rs_threshold=1.5_2.0",  # keeps ratios in [1/2, 1/1.5]: none
        ]
    )
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == 1.0
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == 1.0
    assert metrics["rollout_corr/rollout_rs_token_k1_mean"] == pytest.approx(0.0, abs=1e-3)
    assert metrics["actor/grad_norm"] == 0.0
    assert metrics["actor/pg_loss"] == 0.0
