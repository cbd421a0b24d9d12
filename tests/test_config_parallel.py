"""The sequence-parallel and sharding keys (verl's names): checked against the world,
packing and the model's heads before anything starts, and handed to the engines."""

from __future__ import annotations

import json

import pytest

from rayrl.config import ConfigError, load_config
from rayrl.config.layout import MeshError, MeshSpec
from rayrl.workers.common import engine_kwargs, reference_kwargs

WORLD_8 = [
    "trainer.nnodes=2",
    "trainer.n_gpus_per_node=4",
    "data.train_batch_size=8",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
]


def _load(*overrides: str):
    return load_config("grpo", [*WORLD_8, *overrides])


def test_keys_are_real_and_reach_the_engines():
    cfg = _load(
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
        "actor_rollout_ref.actor.fsdp_config.fsdp_size=4",
        "actor_rollout_ref.actor.use_kl_loss=true",
    )
    arr = cfg.actor_rollout_ref
    assert arr.ref.ulysses_sequence_parallel_size == 2  # follows the actor's, as in verl
    assert arr.ref.fsdp_config.fsdp_size == 4
    actor = engine_kwargs(
        arr.model, arr.actor.fsdp_config, 0, sp=arr.actor.ulysses_sequence_parallel_size
    )
    assert actor["ulysses_sequence_parallel_size"] == 2 and actor["fsdp_size"] == 4
    ref = reference_kwargs(arr.model, arr.ref.fsdp_config, 0, sp=2)
    assert ref["ulysses_sequence_parallel_size"] == 2 and ref["fsdp_size"] == 4
    assert cfg.critic.ulysses_sequence_parallel_size == 1


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=3",
            "must be at least 1 and divide the 8 ranks",
        ),
        (
            "actor_rollout_ref.actor.fsdp_config.fsdp_size=3",
            "actor.fsdp_config.fsdp_size=3 must divide the 8 ranks",
        ),
        ("actor_rollout_ref.actor.fsdp_config.fsdp_size=0", "use -1 (shard over every rank)"),
    ],
)
def test_layouts_the_world_cannot_have(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _load(override)


def test_sequence_parallel_needs_packing_and_whole_heads(tmp_path):
    with pytest.raises(ConfigError, match="set actor_rollout_ref.model.use_remove_padding=true"):
        _load(
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
            "actor_rollout_ref.model.use_remove_padding=false",
        )
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"num_attention_heads": 6, "num_key_value_heads": 3})
    )
    with pytest.raises(
        ConfigError, match="ulysses_sequence_parallel_size=4 .* must divide the model's 6"
    ):
        _load(
            f"actor_rollout_ref.model.path={model}",
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=4",
        )
    with pytest.raises(ConfigError, match="3 key/value heads: one must divide the other"):
        _load(
            f"actor_rollout_ref.model.path={model}",
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
        )


def test_batch_chain_splits_over_data_parallel_groups():
    """With SP 4 over 8 ranks there are 2 data-parallel groups: 32 samples give each 16,
    which micro-batches of 2 split; SP 1 would give each rank 4."""
    _load("actor_rollout_ref.actor.ulysses_sequence_parallel_size=4")
    with pytest.raises(
        ConfigError, match="32 samples / 2 ranks = 16, does not split into micro-batches of"
    ):
        _load(
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
        )


def test_mesh_spec_arithmetic():
    spec = MeshSpec(world=16, sp=4, fsdp_size=8)
    assert (spec.shard, spec.replicate, spec.dp, spec.hybrid) == (8, 2, 4, True)
    assert [spec.dp_rank(r) for r in (0, 3, 4, 15)] == [0, 0, 1, 3]
    assert spec.sp_ranks(6) == [4, 5, 6, 7]
    assert MeshSpec(world=8).describe().startswith("8 rank(s): FSDP, shard 8")
    with pytest.raises(MeshError):
        MeshSpec(world=8, sp=16)
