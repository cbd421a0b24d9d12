"""A vision-language policy in the config (issue 48): it loads with the hf or the native
rollout and a critic-free estimator (LoRA too), multi-turn episodes (hf) and
asynchronous rollouts, verl's freeze_vision_tower and mm_processor_kwargs are read, and
what is not built yet is refused before anything starts, naming what to change."""

from __future__ import annotations

import json

import pytest

from rayrl.config import load_config
from rayrl.config.errors import ConfigError
from rayrl.data import DataError
from rayrl.trainer.data import vision_processor

MICRO = [
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
    "critic.ppo_micro_batch_size_per_gpu=4",
]


def _model(tmp_path, model_type: str = "qwen2_5_vl", vision: bool = True):
    model = tmp_path / model_type
    model.mkdir()
    config = {"model_type": model_type, **({"vision_config": {}} if vision else {})}
    (model / "config.json").write_text(json.dumps(config))
    return model


def test_a_vision_language_policy_loads_with_verls_keys(tmp_path):
    model = _model(tmp_path)
    cfg = load_config(
        "grpo",
        [
            f"actor_rollout_ref.model.path={model}",
            "actor_rollout_ref.actor.freeze_vision_tower=true",
            "data.mm_processor_kwargs={max_pixels: 12544}",
            "actor_rollout_ref.rollout.limit_images=2",  # vLLM's: accepted, no effect
            "actor_rollout_ref.model.lora_rank=8",
        ],
        warn=lambda message: None,
    )
    assert cfg.actor_rollout_ref.actor.freeze_vision_tower is True
    assert cfg.data.mm_processor_kwargs == {"max_pixels": 12544}


def test_a_vision_language_policy_loads_with_the_native_rollout(tmp_path):
    model = _model(tmp_path)
    cfg = load_config(
        "grpo", [f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.rollout.name=native"]
    )
    assert cfg.actor_rollout_ref.rollout.name == "native"


@pytest.mark.parametrize(
    "override, named, change",
    [
        (
            "actor_rollout_ref.rollout.name=native "
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
            "tensor-parallel rollout on the native engine",
            "tensor_model_parallel_size=1",
        ),
        (
            "actor_rollout_ref.rollout.name=native actor_rollout_ref.rollout.multi_turn.enable=true",
            "multi-turn episodes on the native engine",
            "rollout.name=hf",
        ),
        ("algorithm.adv_estimator=gae", "a critic", "adv_estimator=grpo"),
        ("data.loader=ray", "Ray Data loader", "data.loader=default"),
        (
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
            "Ulysses",
            "ulysses_sequence_parallel_size=1",
        ),
    ],
)
def test_what_is_not_built_for_a_vision_language_policy_is_refused(
    tmp_path, override, named, change
):
    model = _model(tmp_path)
    with pytest.raises(ConfigError) as refused:
        load_config(
            "grpo",
            [
                *MICRO,
                f"actor_rollout_ref.model.path={model}",
                "trainer.n_gpus_per_node=2",
                *override.split(),
            ],
        )
    message = str(refused.value)
    assert "is a vision-language model" in message and "issue 48" in message
    assert named in message and change in message


def test_multi_turn_episodes_and_asynchronous_rollouts_compose_with_images(tmp_path):
    model = _model(tmp_path)
    cfg = load_config(
        "grpo",
        [
            f"actor_rollout_ref.model.path={model}",
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            "actor_rollout_ref.rollout.mode=async",
            "rollout.n_gpus_per_node=1",
            "trainer.device=cpu",
        ],
        warn=lambda message: None,
    )
    assert cfg.asynchronous and cfg.actor_rollout_ref.rollout.multi_turn.enable


def test_a_vision_tower_frozen_on_a_text_model_or_a_vision_critic_is_refused(tmp_path):
    text = _model(tmp_path, "qwen2", vision=False)
    with pytest.raises(ConfigError, match="text-only model.*set it to false"):
        load_config(
            "grpo",
            [
                f"actor_rollout_ref.model.path={text}",
                "actor_rollout_ref.actor.freeze_vision_tower=true",
            ],
        )
    vision = _model(tmp_path)
    with pytest.raises(ConfigError, match="no value model with a vision tower"):
        load_config("ppo", [*MICRO, f"critic.model.path={vision}"])


def test_a_family_rayrl_does_not_train_is_named_where_its_processor_loads(tmp_path):
    cfg = load_config("grpo")
    with pytest.raises(DataError, match="qwen3_vl.*deepstack.*Qwen2.5-VL"):
        vision_processor(cfg, str(_model(tmp_path, "qwen3_vl")), tokenizer=None)
    assert vision_processor(cfg, str(_model(tmp_path, "qwen2", vision=False)), None) is None
