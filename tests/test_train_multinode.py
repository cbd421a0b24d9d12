"""`rayrl train` against an existing two-node cluster (`resources.address`), with the
actor's ranks placed one per node (`trainer.nnodes=2`) and a reward worker beside each."""

from __future__ import annotations

import json
import re

import pytest
import ray

from rayrl.cli.main import main

pytestmark = pytest.mark.slow


def test_train_joins_a_two_node_cluster_and_spreads_the_actor(ray_multinode, tmp_path, capsys):
    cluster = ray_multinode([{"num_cpus": 2}, {"num_cpus": 2}])
    ray.shutdown()  # the trainer connects by itself, through resources.address
    code = main(
        [
            "train",
            "-c",
            "grpo",
            f"resources.address={cluster.address}",
            "trainer.nnodes=2",
            "trainer.n_gpus_per_node=1",
            "trainer.device=cpu",
            "trainer.total_training_steps=1",
            "data.train_batch_size=2",
            "data.max_response_length=4",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "trainer.val_before_train=false",
            f"trainer.output_dir={tmp_path}",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out[-2000:]
    placed = re.search(r"actor_rollout_ref: 2 worker\(s\) on node\(s\) (\w+), (\w+)", out)
    assert placed and placed.group(1) != placed.group(2), out[-2000:]
    # a reward worker on each of the actor's nodes, in the same order (reward.workers_per_node)
    rewards = re.search(r"reward: 2 worker\(s\) on node\(s\) (\w+), (\w+)", out)
    assert rewards and rewards.groups() == placed.groups(), out[-2000:]
    assert (tmp_path / "checkpoints" / "global_step_1" / "actor" / "rng" / "rank1.pt").is_file()
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    # trainer.balance_batch (verl's default, on): both splits over the 2 ranks balanced
    step = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    for stage in ("gen", "train"):
        assert step[f"perf/dp_imbalance/{stage}"] <= step[f"perf/dp_imbalance_before/{stage}"]
