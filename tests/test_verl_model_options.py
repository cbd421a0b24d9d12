"""verl's model and prompt options that change what is built or read: each one set as a
verl command line sets it, and checked where it takes effect.

- `actor_rollout_ref.model.override_config` (and `critic.model.override_config`): the
  values are on the HF config of the training engine's model, the reference's, the
  rollout engines' (hf and native) and the critic's;
- `actor_rollout_ref.model.custom_chat_template`: prompts are rendered with it;
- `data.apply_chat_template_kwargs`: the chat template sees the arguments (prompts and
  multi-turn episodes);
- `actor_rollout_ref.model.exclude_modules`: LoRA leaves those modules without adapters.
"""

from __future__ import annotations

import pytest

from engine_cases import tiny_model_dir  # noqa: F401 (fixture)
from rayrl.config import load_config
from rayrl.data import write_parquet
from rayrl.models.config_overrides import apply_config_overrides
from rayrl.models.loading import load_tokenizer
from rayrl.rollout import HFRolloutEngine, make_rollout_engine
from rayrl.train.engine import TrainEngine
from rayrl.train.lora import LoraSpec, apply_lora
from rayrl.trainer.data import load_datasets
from rayrl.workers.agent import episode_settings
from rayrl.workers.common import engine_kwargs, reference_kwargs

ARR = "actor_rollout_ref"


def config(*overrides: str, warnings: list | None = None):
    return load_config("grpo", list(overrides), warn=(warnings or []).append)


def test_override_config_reaches_every_model_built(tiny_model_dir):  # noqa: F811
    cfg = config(
        f"{ARR}.model.path={tiny_model_dir}",
        f"{ARR}.model.override_config.max_position_embeddings=96",
        f"{ARR}.model.override_config.rope_theta=5000.0",
        "critic.model.override_config.max_position_embeddings=80",
    )
    arr = cfg.actor_rollout_ref
    assert arr.model.override_config == {"max_position_embeddings": 96, "rope_theta": 5000.0}
    fsdp = arr.actor.fsdp_config
    actor = TrainEngine(tiny_model_dir, **engine_kwargs(arr.model, fsdp, seed=0))
    ref = TrainEngine(
        tiny_model_dir,
        trainable=False,
        weights_from=actor,
        **reference_kwargs(arr.model, arr.ref.fsdp_config, seed=0),
    )
    critic = TrainEngine(
        tiny_model_dir,
        value_head=True,
        **engine_kwargs(cfg.critic.model, cfg.critic.model.fsdp_config, seed=0),
    )
    for engine in (actor, ref):
        assert engine.model.config.max_position_embeddings == 96
        assert engine.model.config.rope_theta == 5000.0
    assert critic.model.config.max_position_embeddings == 80
    hf = HFRolloutEngine(model_path=str(tiny_model_dir), config_overrides=arr.model.override_config)
    assert hf.model.config.max_position_embeddings == 96
    native = make_rollout_engine(
        "native",
        model_path=str(tiny_model_dir),
        device="cpu",
        config_overrides=arr.model.override_config,
    )
    assert native.max_model_len == 96  # the native engine's limit follows the config


def test_override_config_sets_sub_configs_and_names_a_bad_one(tiny_model_dir):  # noqa: F811
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(tiny_model_dir)
    apply_config_overrides(hf, {"model_config": {"hidden_act": "gelu"}}, "model.override_config")
    assert hf.hidden_act == "gelu"  # verl's Megatron spelling means the same
    with pytest.raises(ValueError, match=r"model.override_config.hidden_act: .* no sub-config"):
        apply_config_overrides(hf, {"hidden_act": {"x": 1}}, "model.override_config")


def _prompt_rows(tmp_path):
    rows = [
        {
            "data_source": "t",
            "prompt": [{"role": "user", "content": f"question {i}"}],
            "reward_model": {"ground_truth": str(i)},
        }
        for i in range(2)
    ]
    return write_parquet(rows, tmp_path / "train.parquet")


TEMPLATE = (
    "{% for m in messages %}<<{{ m['role'] }}|{{ m['content'] }}>>{% endfor %}"
    "effort={{ reasoning_effort | default('none') }}"
)


def test_custom_chat_template_and_its_kwargs_render_the_prompts(tmp_path, tiny_model_dir):  # noqa: F811
    cfg = config(
        f"{ARR}.model.path={tiny_model_dir}",
        f"data.train_files={_prompt_rows(tmp_path)}",
        f"{ARR}.model.custom_chat_template={TEMPLATE!r}",
        "data.apply_chat_template_kwargs.reasoning_effort=medium",
    )
    model = cfg.actor_rollout_ref.model
    assert model.custom_chat_template == TEMPLATE
    tokenizer = load_tokenizer(
        tiny_model_dir, key="model.path", chat_template=model.custom_chat_template
    )
    train, _ = load_datasets(cfg, tokenizer)
    text = tokenizer.decode(train.prompt_ids[0])
    assert text.replace(" ", "") == "<<user|question0>>effort=medium"
    assert episode_settings(cfg)["chat_template_kwargs"] == {"reasoning_effort": "medium"}


def test_exclude_modules_leaves_modules_without_adapters(tiny_model_dir):  # noqa: F811
    from transformers import AutoModelForCausalLM

    cfg = config(
        f"{ARR}.model.lora_rank=4",
        f"{ARR}.model.exclude_modules=.*mlp.*",
    )
    spec = LoraSpec.from_model_config(cfg.actor_rollout_ref.model)
    assert spec.exclude_modules == ".*mlp.*"
    model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir), spec)
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in model.named_parameters() if ".lora_A" in n}
    assert adapted and not any(".mlp." in n for n in adapted)
    assert any(".self_attn." in n for n in adapted)
