"""The new algorithms in the real trainer on a local Ray: PPO with GAE, PF-PPO resampling
and the SAPO loss (GPG and GMPO go through the same path as GRPO and the PPO loss:
their parity and wiring tests cover them without a run)."""

from __future__ import annotations

import math

import pytest

from rayrl.config import load_config
from rayrl.trainer.ppo import PPOTrainer
from rayrl.trainer.run import Run

SMALL = [
    "data.train_batch_size=2",
    "data.max_response_length=8",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=1",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "critic.ppo_mini_batch_size=1",
    "critic.ppo_micro_batch_size_per_gpu=2",
    "trainer.total_training_steps=2",
    "trainer.device=cpu",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "trainer.export_hf=false",
]


def _fit(source: str, overrides: list[str]) -> list[dict]:
    run = Run(PPOTrainer(load_config(source, [*SMALL, *overrides])))
    try:
        return run.setup().fit()
    finally:
        run.shutdown()


@pytest.mark.slow
def test_ppo_with_pf_ppo_and_sapo_trains(ray_local, tmp_path):
    history = _fit(
        "ppo",
        [
            f"trainer.output_dir={tmp_path}",
            "algorithm.use_pf_ppo=true",
            "algorithm.pf_ppo.reweight_method=max_random",
            "actor_rollout_ref.actor.policy_loss.loss_mode=sapo",
        ],
    )
    assert len(history) == 2
    for metrics in history:
        for key in ("actor/pg_loss", "critic/vf_loss", "critic/advantages/mean"):
            assert math.isfinite(metrics[key]), key
        assert 0 < metrics["pf_ppo/unique_fraction"] <= 1
        assert metrics["actor/pg_clipfrac"] == 0.0  # SAPO gates, it does not clip
