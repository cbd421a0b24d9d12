"""`rayrl plan` against a real local Ray: pools from a config, placement, verdict."""

from __future__ import annotations

import ray

from rayrl.cli.main import main
from rayrl.config import load_config
from rayrl.trainer.resources import pools_from_config, resolve_device


def test_pools_from_config_follow_the_topology():
    cfg = load_config(
        "grpo",
        [
            "trainer.nnodes=2",
            "trainer.n_gpus_per_node=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "resources.capacity_factor=1.25",
        ],
    )
    assert resolve_device(cfg, cluster_gpus=8) == "cuda"
    assert resolve_device(cfg, cluster_gpus=0) == "cpu"
    actor, reward = pools_from_config(cfg, "cuda")
    assert actor.per_node == [4, 4] and actor.bundle == {"CPU": 1.0, "GPU": 1.0}
    assert actor.num_spares == 2
    assert reward.bundle == {"CPU": 1.0} and reward.num_spares == 1
    assert "GPU" not in pools_from_config(cfg, "cpu")[0].bundle


def test_plan_fits_and_never_fits(ray_local, capsys):
    address = ray.get_runtime_context().gcs_address
    assert main(["plan", "--address", address, "-c", "grpo", "trainer.device=cuda"]) == 0
    out = capsys.readouterr().out
    assert "FITS" in out and "actor_rollout_ref" in out and "STRICT_PACK" in out
    # 8 GPU bundles on one node of 4 GPUs can never be placed.
    code = main(
        [
            "plan",
            "--address",
            address,
            "-c",
            "grpo",
            "trainer.device=cuda",
            "trainer.n_gpus_per_node=8",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        ]
    )
    assert code == 2
    assert "NEVER" in capsys.readouterr().out


def test_plan_exits_1_while_resources_are_held(ray_local, capsys):
    from ray.util.placement_group import placement_group, remove_placement_group

    address = ray.get_runtime_context().gcs_address
    holder = placement_group([{"GPU": 4.0}], name="rayrl/other/gpus")
    assert holder.wait(10)
    try:
        assert main(["plan", "--address", address, "trainer.device=cuda"]) == 1
        out = capsys.readouterr().out
        assert "BUSY" in out and "rayrl/other/gpus" in out
    finally:
        remove_placement_group(holder)
