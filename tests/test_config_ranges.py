"""Every numeric config key is checked against its range at load (`rayrl.config.ranges`):
a bad value is refused naming the key, the value and the range; verl's defaults, the
built-in configs and the special values (-1: never, null: unset, temperature 0:
greedy) still load."""

from __future__ import annotations

import pytest

from rayrl.config import ConfigError, load_config
from rayrl.config.load import builtin_configs
from rayrl.config.ranges import RANGES, Range

A, R = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
BAD = [
    (f"{A}.optim.lr", "-1e-06", ">= 0"),
    ("critic.optim.lr", "-0.1", ">= 0"),
    (f"{A}.optim.weight_decay", "-0.01", ">= 0"),
    (f"{A}.optim.eps", "0.0", "> 0"),
    (f"{A}.optim.lr_warmup_steps_ratio", "1.5", "in [0, 1]"),
    (f"{A}.optim.lr_warmup_steps", "-2", ">= -1"),
    (f"{A}.optim.lr", "nan", ">= 0"),
    (f"{R}.temperature", "-0.5", ">= 0"),
    (f"{R}.val_kwargs.temperature", "-1.0", ">= 0"),
    (f"{R}.top_p", "0.0", "in (0, 1]"),
    (f"{R}.top_p", "1.5", "in (0, 1]"),
    (f"{R}.val_kwargs.top_p", "0.0", "in (0, 1]"),
    (f"{R}.top_k", "-2", ">= -1"),
    (f"{R}.val_kwargs.top_k", "-5", ">= -1"),
    (f"{R}.n", "0", ">= 1"),
    (f"{R}.val_kwargs.n", "0", ">= 1"),
    (f"{R}.gpu_memory_utilization", "0.0", "in (0, 1]"),
    (f"{R}.gpu_memory_utilization", "1.2", "in (0, 1]"),
    (f"{A}.clip_ratio_low", "-0.2", ">= 0"),
    (f"{A}.clip_ratio_high", "-0.28", ">= 0"),
    (f"{A}.clip_ratio_c", "0.5", "> 1"),
    (f"{A}.entropy_coeff", "-0.01", ">= 0"),
    (f"{A}.kl_loss_coef", "-0.001", ">= 0"),
    (f"{A}.ppo_epochs", "0", ">= 1"),
    (f"{A}.ppo_mini_batch_size", "0", ">= 1 or null"),
    (f"{A}.ppo_micro_batch_size_per_gpu", "-1", ">= 1 or null"),
    ("algorithm.kl_ctrl.kl_coef", "-0.001", ">= 0"),
    ("algorithm.gamma", "1.5", "in [0, 1]"),
    ("algorithm.lam", "-0.1", "in [0, 1]"),
    ("critic.cliprange_value", "-0.5", ">= 0"),
    ("critic.ppo_epochs", "0", ">= 1"),
    ("data.train_batch_size", "0", ">= 1"),
    ("data.max_prompt_length", "0", ">= 1"),
    ("data.max_response_length", "-4", ">= 1"),
    ("data.val_batch_size", "0", ">= 1 or null"),
    ("trainer.total_epochs", "0", ">= 1"),
    ("trainer.total_training_steps", "0", ">= 1 or null"),
    ("trainer.save_freq", "0", ">= 1 or -1"),
    ("trainer.test_freq", "-3", ">= 1 or -1"),
    ("trainer.max_actor_ckpt_to_keep", "0", ">= 1 or null"),
    ("reward.max_error_rate", "1.5", "in [0, 1]"),
    ("reward.timeout_s", "0", "> 0"),
    ("resources.capacity_factor", "0.5", ">= 1"),
]


@pytest.mark.parametrize(("key", "value", "valid"), BAD, ids=[f"{k}={v}" for k, v, _ in BAD])
def test_a_value_out_of_range_is_refused_at_load_naming_key_value_and_range(key, value, valid):
    with pytest.raises(ConfigError) as info:
        load_config("grpo", [f"{key}={value}"])
    text = str(info.value)
    assert text.startswith(f"{key}=") and "is out of range" in text, text
    assert f"use a value {valid}" in text, text


def test_verl_defaults_builtins_and_special_values_load():
    micro = [
        f"{A}.ppo_micro_batch_size_per_gpu=4",
        f"{R}.log_prob_micro_batch_size_per_gpu=4",
        "critic.ppo_micro_batch_size_per_gpu=4",
    ]
    load_config(None, micro)  # verl's own defaults
    names = builtin_configs()
    assert {"ppo", "grpo", "demo"} <= set(names)
    for name in names:
        load_config(name, [])
    special = [
        f"{R}.temperature=0",  # greedy
        f"{R}.top_k=-1",
        f"{R}.top_k=0",
        f"{A}.optim.lr_warmup_steps=-1",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        "trainer.total_training_steps=null",
        "data.val_batch_size=null",
        "reward.max_error_rate=1.0",
        f"{A}.optim.clip_grad=0",
    ]
    cfg = load_config("grpo", special)
    assert cfg.actor_rollout_ref.rollout.temperature == 0


def test_the_rule_table_reads_as_it_checks():
    unit = Range(low=0, high=1, low_open=True, note="n")
    assert unit.describe() == "in (0, 1]" and unit.holds(1) and not unit.holds(0)
    assert not unit.holds(True) and not unit.holds("0.5") and not unit.holds(float("nan"))
    never = Range(low=1, also=(-1,))
    assert never.describe() == ">= 1 or -1" and never.holds(-1) and not never.holds(-2)
    assert Range(low=1, also=(None,)).holds(None)
    assert all(key.count(".") >= 1 for key in RANGES)


def test_lora_alpha_zero_loads_with_lora_off_and_is_refused_with_lora_on():
    """verl's e2e scripts pass lora_alpha=lora_rank=0 (LoRA off: alpha is not read)."""
    M = "actor_rollout_ref.model"
    assert load_config("grpo", [f"{M}.lora_rank=0", f"{M}.lora_alpha=0"]).actor_rollout_ref
    with pytest.raises(ConfigError, match="lora_alpha=0 with lora_rank=8: LoRA's scale"):
        load_config("grpo", [f"{M}.lora_rank=8", f"{M}.lora_alpha=0"])
    with pytest.raises(ConfigError, match="lora_alpha=-1 is out of range"):
        load_config("grpo", [f"{M}.lora_alpha=-1"])
