"""The PPO loop end to end on real Ray: GRPO through `rayrl train`, PPO with a critic."""

from __future__ import annotations

import json
import math
import os

import pytest

from rayrl.cli.main import main
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
]


@pytest.mark.slow
def test_grpo_with_kl_loss_through_the_cli(ray_local, tmp_path, capsys):
    code = main(
        [
            "train",
            "-c",
            "grpo",
            *SMALL,
            f"trainer.output_dir={tmp_path}",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",  # one mini-batch: on-policy
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "metrics per step" in out and "2/2" in out
    # A CPU-only run of one rank: the reward scores in the actor's process, whose bundle
    # holds the reward's CPU too, and torch uses both (at most the machine's cores).
    [worker] = json.loads((tmp_path / "workers.json").read_text())["workers"]
    assert worker["group"] == "actor_rollout_ref" and worker["roles"] == ["actor", "reward"]
    assert worker["threads"] == min(2, len(os.sched_getaffinity(0)))
    assert worker["init_span"][0] < worker["init_span"][1]
    # One epoch over one mini-batch: no separate old-log-prob pass; entropy from the update.
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "timing_s/step" in row]  # not the validation before
    assert len(steps) == 2
    for row in steps:
        assert row["timing_s/old_log_prob"] == 0.0 and math.isfinite(row["actor/entropy"])
        assert 0 < row["timing_s/controller_overhead"] < row["timing_s/step"]
        # the step boundary's snapshot is part of the step and of its throughput
        assert 0 < row["timing_s/snapshot"] < row["timing_s/step"]
        tokens_per_s = row["perf/total_num_tokens"] / row["timing_s/step"]
        assert row["perf/throughput"] == pytest.approx(tokens_per_s, rel=1e-6)


@pytest.mark.slow
def test_grpo_steps_with_the_native_rollout_engine(ray_local, tmp_path):
    cfg = load_config(
        "grpo",
        [
            *SMALL,
            f"trainer.output_dir={tmp_path}",
            "actor_rollout_ref.rollout.name=native",
            "reward.colocate=false",
        ],
    )
    run = Run(PPOTrainer(cfg))
    try:
        run.setup()
        assert run.trainer.roles.actor.device_info()[0]["rollout"] == "NativeRolloutEngine"
        assert [g.role for g in run.groups] == ["actor_rollout_ref", "reward"]
        # started side by side: the reward's init began before the actor's ended
        (_, actor_end), (reward_start, _) = (g.infos[0]["init_span"] for g in run.groups)
        assert reward_start < actor_end
        history = run.fit()
    finally:
        run.shutdown()
    assert len(history) == 2
    for metrics in history:
        for key in ("actor/pg_loss", "timing_s/gen", "response_length/mean", "critic/score/mean"):
            assert key in metrics and math.isfinite(metrics[key]), key


@pytest.mark.slow
def test_ppo_with_gae_critic_and_kl_in_reward(ray_local, tmp_path):
    cfg = load_config(
        "ppo", [*SMALL, f"trainer.output_dir={tmp_path}", "actor_rollout_ref.rollout.n=2"]
    )
    trainer = PPOTrainer(cfg)
    assert trainer.use_critic and trainer.use_ref
    run = Run(trainer)
    try:
        history = run.setup().fit()
    finally:
        run.shutdown()
    assert len(history) == 2
    for metrics in history:
        for key in (
            "critic/vf_loss",
            "actor/pg_loss",
            "actor/reward_kl_penalty",
            "timing_s/values",
            "timing_s/update_critic",
            "perf/throughput",
            "critic/score/mean",
        ):
            assert key in metrics and math.isfinite(metrics[key]), key
        assert metrics["timing_s/old_log_prob"] > 0  # KL in the reward reads old log-probs


def test_steps_and_batches_follow_the_loaded_data(tmp_path):
    cfg = load_config(
        "grpo",
        [
            "data.train_batch_size=4",
            "data.synthetic_size=10",
            "trainer.total_epochs=2",
            "trainer.total_training_steps=null",
            f"trainer.output_dir={tmp_path}",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        ],
    )
    run = Run(PPOTrainer(cfg))
    run.data = run.trainer.load_data()
    assert len(run.data.dataset) == 10
    assert run.total_steps() == 4  # 2 whole batches of 4 per epoch, 2 epochs
    steps = [(step, prompts.meta["step"], len(prompts)) for step, prompts in run.batches()]
    assert steps == [(i, i, 4) for i in range(4)]
    epoch0 = [list(p["uid"]) for _, p in run.batches()][:2]
    assert epoch0 != [list(p["uid"]) for _, p in run.batches()][2:]  # reshuffled per epoch


@pytest.mark.slow
def test_step_snapshots_auto_turns_off_when_the_state_would_crowd_the_object_store(
    ray_local, tmp_path, monkeypatch
):
    from rayrl.trainer import replay

    monkeypatch.setattr(replay, "SNAPSHOT_STORE_SHARE", 0.0)  # any state is too large
    printed: list[str] = []
    cfg = load_config(
        "grpo",
        [*SMALL, f"trainer.output_dir={tmp_path}", "trainer.total_training_steps=1"],
    )
    run = Run(PPOTrainer(cfg, print_fn=printed.append))
    try:
        history = run.setup().fit()
    finally:
        run.shutdown()
    assert run.replay.use_snapshots is False and not run.replay.snapshots
    assert any("step snapshots off" in line and "GiB" in line for line in printed)
    assert history[-1]["timing_s/snapshot"] == 0.0
