"""`rayrl train` of a mixture of experts with expert parallelism, as a user runs it on a
CPU: GRPO with the KL loss on 2 ranks at ``expert_parallel_size=2``. The reference takes
the actor's size (``ref.expert_parallel_size`` unset) and computes the KL's log-probs
split as the actor is (`test_ref_expert_parallel` checks its experts' split and its
log-probs against one process); every step's rollout takes the updated experts in
buckets (`rayrl.train.expert_sync`, checked bit for bit in `test_expert_sync`)."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from conftest import start_local_ray
from rayrl.cli.main import main

pytestmark = pytest.mark.slow  # Ray, 2 actor ranks and 2 steps: a few minutes on 2 cores

RUN = [
    "trainer.n_gpus_per_node=2",
    "trainer.device=cpu",
    "actor_rollout_ref.actor.expert_parallel_size=2",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "trainer.total_training_steps=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32",
    "trainer.logger=[jsonl]",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "trainer.export_hf=false",
]


def test_grpo_with_kl_loss_at_ep2_on_two_cpu_ranks(tmp_path):
    from rayrl.models.tiny import build_tiny_model

    start_local_ray()
    model = build_tiny_model(tmp_path / "m", family="qwen3_moe", seed=4)
    out = tmp_path / "run"
    args = [f"actor_rollout_ref.model.path={model}", f"trainer.output_dir={out}"]
    assert main(["train", "-c", "demo", *RUN, *args]) == 0
    steps = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").open()) if "step" in r}
    first, second = steps[1], steps[2]
    resolved = yaml.safe_load((out / "config.yaml").read_text())["actor_rollout_ref"]
    assert resolved["ref"]["expert_parallel_size"] == 2  # unset: the actor's
    # the reference is the initial policy: the KL is 0 before the first update, not after
    assert first["actor/kl_loss"] == 0.0
    assert math.isfinite(second["actor/kl_loss"]) and second["actor/kl_loss"] > 0
    # the second rollout ran on the updated weights, streamed into its copy
    assert second["timing_s/weight_sync"] > 0
