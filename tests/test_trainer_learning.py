"""End to end through `rayrl train`'s trainer with the real roles: the policy learns an
easy task (reward rises past a threshold within a bounded number of steps, with DAPO's
clip-higher and dynamic sampling on), and ReMax runs with its greedy baseline, the
overlong penalty and truncation masking."""

from __future__ import annotations

import math

import pytest

from rayrl.cli.train_cmd import train
from rayrl.config import load_config

pytestmark = pytest.mark.slow

# Easy for a random tiny model: the share of lowercase letters in the response (about
# two thirds at the start); `acc` says whether it passes 0.9, for dynamic sampling.
REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    text = solution_str.replace(" ", "")
    share = sum("a" <= c <= "z" for c in text) / len(text) if text else 0.0
    return {"score": share, "acc": float(share > 0.9)}
"""

SMALL = [
    "data.train_batch_size=8",
    "data.max_response_length=8",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
    "actor_rollout_ref.actor.use_kl_loss=false",
    "trainer.device=cpu",
    "trainer.seed=1",
]


def _config(tmp_path, *overrides: str):
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    return load_config(
        "grpo",
        [
            *SMALL,
            f"trainer.output_dir={tmp_path}",
            f"custom_reward_function.path={reward}",
            *overrides,
        ],
    )


def test_grpo_learns_an_easy_task(ray_local, tmp_path):
    """Seeded; GRPO with DAPO's clip-higher and dynamic sampling. `reward/score/mean`
    covers every sample of a step's prompts (before the group filter)."""
    cfg = _config(
        tmp_path,
        "actor_rollout_ref.actor.optim.lr=1e-2",
        "trainer.total_training_steps=12",
        "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.metric=acc",
        "algorithm.filter_groups.max_num_gen_batches=10",
    )
    history = train(cfg)
    scores = [m["reward/score/mean"] for m in history]
    start, end = sum(scores[:3]) / 3, sum(scores[-3:]) / 3
    assert end >= 0.85 and end >= start + 0.15, f"scores did not rise enough: {scores}"
    assert max(m["train/num_gen_batches"] for m in history) > 1  # extra rounds happened
    assert all(math.isfinite(m["actor/pg_loss"]) for m in history)


def test_remax_with_overlong_penalty_and_truncation_masking(ray_local, tmp_path):
    cfg = _config(
        tmp_path,
        "algorithm.adv_estimator=remax",
        "trainer.total_training_steps=2",
        "reward_model.overlong_buffer.enable=true",
        "reward_model.overlong_buffer.len=4",
        "reward_model.overlong_buffer.penalty_factor=0.5",
        "reward_model.overlong_buffer.log=true",
        "algorithm.mask_truncated_samples=true",
    )
    history = train(cfg)
    assert len(history) == 2
    for m in history:
        for key in (
            "timing_s/gen_baseline",
            "reward/overlong_penalty/mean",
            "response_length/masked_truncated",
            "actor/pg_loss",
            "actor/entropy",
        ):
            assert key in m and math.isfinite(m[key]), key
        assert m["reward/overlong_penalty/mean"] < 0  # responses run into the buffer
