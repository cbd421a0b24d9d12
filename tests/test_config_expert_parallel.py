"""``actor_rollout_ref.actor.expert_parallel_size``: checked against the world and the
model's experts before anything starts; a dense model with ep > 1 is an error naming the
key."""

from __future__ import annotations

import pytest

from rayrl.config import ConfigError, load_config

KEY = "actor_rollout_ref.actor.expert_parallel_size"
WORLD_4 = [
    "trainer.n_gpus_per_node=4",
    "data.train_batch_size=8",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from rayrl.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("m") / "moe", family="qwen3_moe")


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    from rayrl.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("m") / "dense")


def _load(path, *overrides):
    return load_config("grpo", [*WORLD_4, f"actor_rollout_ref.model.path={path}", *overrides])


def test_default_is_off_and_a_fitting_size_loads(moe_dir):
    assert _load(moe_dir).actor_rollout_ref.actor.expert_parallel_size == 1
    assert _load(moe_dir, f"{KEY}=4").actor_rollout_ref.actor.expert_parallel_size == 4


@pytest.mark.parametrize(
    ("ep", "words"),
    [(3, "must be at least 1 and divide the 4 data-parallel ranks"), (8, "divide the 4")],
)
def test_a_size_the_world_cannot_split_is_an_error(moe_dir, ep, words):
    with pytest.raises(ConfigError, match=f"{KEY}={ep}.*{words}"):
        _load(moe_dir, f"{KEY}={ep}")


def test_a_dense_model_or_ulysses_with_ep_is_an_error_naming_the_key(dense_dir, moe_dir):
    with pytest.raises(ConfigError, match=f"{KEY}=2.*not a mixture of experts"):
        _load(dense_dir, f"{KEY}=2")
    with pytest.raises(ConfigError, match=f"{KEY}=2 does not run with Ulysses"):
        _load(moe_dir, f"{KEY}=2", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2")


def test_lora_with_ep_is_refused_naming_both_keys_and_loads_at_ep_1(moe_dir):
    """peft's expert adapters crash on the ranks' expert shards (a traceback in the
    first forward): refused at load instead, with what to set."""
    with pytest.raises(ConfigError, match="lora_rank=4.*expert_parallel_size=1 for LoRA"):
        _load(moe_dir, f"{KEY}=2", "actor_rollout_ref.model.lora_rank=4")
    assert _load(moe_dir, "actor_rollout_ref.model.lora_rank=4").actor_rollout_ref.model.lora_rank
