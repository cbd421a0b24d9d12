"""verl's keys that rayrl spells otherwise, each set to a value that is NOT its default
(verl's defaults equal rayrl's, so a key moved onto the wrong field is invisible at
the default): the value lands on the rayrl key this file names, and nothing else of
the resolved config changes. Where a key lands is written out here, apart from the
compat tables (`rayrl.config.compat`), so a table entry pointing at the wrong key
fails; every `Moved` rule of the tables must have its line here. Where the landing is
not a rayrl key (a verl 0.9.1 key with a rule of its own, or a key inside a moved
group that rayrl drops or refuses), the old spelling must do exactly what the new one
does. verl's values that rayrl stores otherwise (engine names, booleans as
frequencies, global micro-batch sizes) are checked the same way.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from rayrl.config import ConfigError, load_config
from rayrl.config.compat import GLOBAL_MICRO_BATCH, Moved, verl_ppo, verl_sft
from rayrl.config.compat.rules import flatten
from rayrl.config.judge import JudgeRolloutConfig
from rayrl.config.load import parse_overrides, source_data
from rayrl.config.sft import load_sft_config, sft_source_data

DATA = Path(__file__).resolve().parent / "data"
ARR = "actor_rollout_ref"

# verl key (or group) -> the rayrl key (or group) it sets; a landing that is itself a
# verl spelling is followed (reward_model.reward_kwargs -> reward.reward_kwargs -> ...)
PPO_LANDS = {
    f"{ARR}.actor.optim.warmup_style": f"{ARR}.actor.optim.lr_scheduler_type",
    f"{ARR}.actor.optim.grad_clip": f"{ARR}.actor.optim.clip_grad",
    f"{ARR}.actor.grad_clip": f"{ARR}.actor.optim.clip_grad",
    f"{ARR}.actor.megatron.router_replay.mode": f"{ARR}.actor.router_replay.mode",
    f"{ARR}.actor.use_prefix_grouper": f"{ARR}.model.share_prompts",
    f"{ARR}.rollout.prompt_length": "data.max_prompt_length",
    f"{ARR}.rollout.response_length": "data.max_response_length",
    "critic.optim.warmup_style": "critic.optim.lr_scheduler_type",
    "critic.optim.grad_clip": "critic.optim.clip_grad",
    "critic.grad_clip": "critic.optim.clip_grad",
    "critic.fsdp": "critic.model.fsdp_config",
    # each role's profiler group, spelled out here (not from the table's own map)
    f"{ARR}.rollout.profiler": "global_profiler.rollout",
    f"{ARR}.actor.profiler": "global_profiler.actor",
    f"{ARR}.ref.profiler": "global_profiler.ref",
    "critic.profiler": "global_profiler.critic",
    "reward.custom_reward_function": "custom_reward_function",
    "custom_reward_function.name": "custom_reward_function.name",
    "reward.reward_model.enable": "reward_model.enable",
    "reward.reward_model.model_path": "reward_model.model.path",
    "reward.reward_kwargs.overlong_buffer_cfg": "reward_model.overlong_buffer",
    "reward.reward_kwargs.max_resp_len": "reward_model.overlong_buffer.max_resp_len",
    "sandbox_fusion": "reward.sandbox_fusion",
    "sandbox_fusion.url": "reward.sandbox_fusion.url",
    "sandbox_fusion.max_concurrent": "reward.sandbox_fusion.max_concurrent",
    "sandbox_fusion.memory_limit_mb": "reward.sandbox_fusion.memory_limit_mb",
    "reward_model.enable": "reward_model.enable",
    "reward_model.num_workers": "reward.num_workers",
    "reward_model.reward_manager": "reward.reward_manager.name",
    "reward_model.reward_loop_source": "reward.reward_manager.source",
    "reward_model.reward_loop_module_path": "reward.reward_manager.module.path",
    "reward_model.reward_loop_class_name": "reward.reward_manager.module.name",
    "reward.reward_model.enable_resource_pool": "reward_model.enable_resource_pool",
    "reward.reward_model.n_gpus_per_node": "reward_model.n_gpus_per_node",
    "reward.reward_model.nnodes": "reward_model.nnodes",
    "reward.reward_model.rollout": "reward_model.rollout",
    "reward_model.enable_resource_pool": "reward_model.enable_resource_pool",
    "reward_model.n_gpus_per_node": "reward_model.n_gpus_per_node",
    "reward_model.nnodes": "reward_model.nnodes",
    **{
        f"reward_model.rollout.{f.name}": f"reward_model.rollout.{f.name}"
        for f in dataclasses.fields(JudgeRolloutConfig)
    },
    "reward_model.reward_kwargs": "reward.reward_kwargs",
    "reward_model.sandbox_fusion": "reward.sandbox_fusion",
    "trainer.default_local_dir": "trainer.output_dir",
    "trainer.log_val_generations": "trainer.val_examples",
}
SFT_LANDS = {
    "model.path": "model.partial_pretrain",
    "model.use_remove_padding": "use_remove_padding",
    "engine": "model.fsdp_config",
    "model.fsdp_config.param_offload": "model.fsdp_config.offload_params",
    "model.fsdp_config.optimizer_offload": "model.fsdp_config.cpu_offload",
    "model.fsdp_config.ulysses_sequence_parallel_size": "ulysses_sequence_parallel_size",
    "optim.lr_scheduler_type": "optim.lr_scheduler",
    "optim.warmup_style": "optim.lr_scheduler",
    "data.messages_key": "data.multiturn.messages_key",
    "data.tools_key": "data.multiturn.tools_key",
    "trainer.default_local_dir": "trainer.output_dir",
}
# keys under a moved group that verl's key list does not hold (older spellings)
EXTRA_LEAVES = [
    "reward.reward_kwargs.overlong_buffer_cfg.len",
    "reward.reward_kwargs.overlong_buffer_cfg.enable",
    "reward_model.reward_kwargs.max_resp_len",
    "reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor",
    "reward_model.sandbox_fusion.url",
    "reward_model.sandbox_fusion.memory_limit_mb",
]
# values for keys whose other values are names (a free value would be refused)
VALUES = {
    "lr_scheduler_type": "cosine",
    "lr_scheduler": "constant",  # rayrl sft's default is cosine
    "reward_manager.name": "dapo",
    "fsdp_config.dtype": "float32",
    "fsdp_config.model_dtype": "bf16",
    "ulysses_sequence_parallel_size": 2,
    "router_replay.mode": "R2",
    "share_prompts": True,  # rayrl's default is auto
    "sandbox_fusion.url": "http://sandbox:8080/run_code",  # an HTTP endpoint, checked at load
    ".ranks": [1],  # a profiled role's traced ranks (rank 0 when empty)
    "torch.contents": ["cpu"],  # what a torch trace records (every kind when empty)
}
# what a landing needs beside it to be a valid config (given to both loads)
CONTEXT = {
    "reward_model.enable": ["reward_model.model.path=/rm"],
    "reward_model.overlong_buffer.enable": ["reward_model.overlong_buffer.len=8"],
    "ulysses_sequence_parallel_size": ["trainer.n_gpus_per_node=2", "use_remove_padding=true"],
}
# keys that follow another by design, with its value (they are not "somewhere else")
FOLLOWS = {
    "data.max_response_length": ["reward_model.overlong_buffer.max_resp_len"],
    f"{ARR}.model.share_prompts": ["critic.model.share_prompts"],
}


class Kind:
    """One trainer's config: how it loads, its compat table, verl's keys for it."""

    def __init__(self, name, lands, rules, load, source, required, keys_file):
        self.name, self.lands, self.rules = name, lands, rules
        self.load, self.source, self.required = load, source, required
        self.keys = [json.loads(line)["key"] for line in (DATA / keys_file).open()]

    def flat(self, overrides: list[str]) -> dict:
        cfg = self.load([*self.required, *overrides])
        return dict(flatten(dataclasses.asdict(cfg)))


PPO = Kind(
    "ppo",
    PPO_LANDS,
    verl_ppo.RULES,
    lambda o: load_config("grpo", o, warn=lambda m: None),
    source_data,
    [],
    "verl_0.9.1_ppo_keys.jsonl",
)
SFT = Kind(
    "sft",
    SFT_LANDS,
    verl_sft.RULES,
    lambda o: load_sft_config(None, o, warn=lambda m: None),
    sft_source_data,
    ["trainer.n_gpus_per_node=1", "data.train_files=[]"],
    "verl_0.9.1_sft_keys.jsonl",
)
KINDS = {"ppo": PPO, "sft": SFT}


def landing(kind: Kind, key: str) -> str:
    """Where `key` lands by this file's table (longest group first, followed)."""
    for _ in range(4):
        groups = [g for g in kind.lands if key == g or key.startswith(g + ".")]
        if not groups:
            return key
        group = max(groups, key=len)
        moved = kind.lands[group] + key[len(group) :]
        if moved == key:
            return key
        key = moved
    raise AssertionError(f"{key}: the table's moves loop")


def moved_keys(kind: Kind) -> list[str]:
    """Every key a `Moved` rule covers: the rule's own key, or verl's keys under it."""
    keys = []
    for pattern, rule in kind.rules.items():
        if not isinstance(rule, Moved):
            continue
        under = [k for k in [*kind.keys, *EXTRA_LEAVES] if k.startswith(pattern + ".")]
        keys += under or [pattern]
    return sorted(set(keys))


def other_value(key: str, default):
    """A value of `key`'s type that is not `default`."""
    for suffix, value in VALUES.items():
        if key.endswith(suffix):
            assert value != default, key
            return value
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 7
    if isinstance(default, float):
        return default / 4 + 0.125
    if isinstance(default, str):
        return default + "_other"
    if default is None:
        return "/elsewhere/other"
    raise AssertionError(f"{key}: no other value for {default!r}")


def test_every_moved_rule_has_its_landing_written_here():
    for kind in KINDS.values():
        moved = {p for p, r in kind.rules.items() if isinstance(r, Moved)}
        assert moved == set(kind.lands), (kind.name, moved ^ set(kind.lands))


CASES = [(name, key) for name, kind in KINDS.items() for key in moved_keys(kind)]


@pytest.mark.parametrize("name, key", CASES, ids=[f"{n}:{k}" for n, k in CASES])
def test_a_moved_key_sets_its_landing_and_nothing_else(name, key):
    kind = KINDS[name]
    target = landing(kind, key)
    context = CONTEXT.get(target, [])
    base = kind.flat(context)
    if target in base:  # a rayrl key: load it and see what changed
        value = other_value(target, base[target])
        got = kind.flat([*context, f"{key}={json.dumps(value)}"])
        changed = {k: got[k] for k in base if got[k] != base[k]}
        expected = {k: value for k in [target, *FOLLOWS.get(target, [])]}
        assert changed == expected, (key, target)
        return
    # not a rayrl key: the old spelling does what the new one does (lands, is dropped
    # with the same warning, or is refused)
    value = "other_value" if key.endswith(("url", "path", "name", "source")) else 7
    assert _source_outcome(kind, key, value) == _source_outcome(kind, target, value), key


def _source_outcome(kind: Kind, key: str, value) -> tuple:
    said: list[str] = []
    try:
        data = kind.source(parse_overrides([f"{key}={json.dumps(value)}"]), "t", said.append)
    except ConfigError as err:
        return ("refused", str(err).replace(key, "KEY"))
    return ("data", data, [m.replace(key, "KEY") for m in said if "sets" not in m])


def _changes(kind: Kind, base: list[str], overrides: list[str]) -> dict:
    """The resolved keys that `overrides` loaded over `base` change, with their values."""
    before, after = kind.flat(base), kind.flat([*base, *overrides])
    return {k: after[k] for k in before if after[k] != before[k]}


@pytest.mark.parametrize("engine", ["vllm", "sglang", "trtllm"])
def test_verls_engine_names_are_stored_as_rayrls_own(engine):
    name = f"{ARR}.rollout.name"
    assert _changes(PPO, [f"{name}=hf"], [f"{name}={engine}"]) == {name: "auto"}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_boolean_frequencies_are_verls_never_and_every_step(kind):
    for key in ("trainer.save_freq", "trainer.test_freq"):
        assert _changes(KINDS[kind], [], [f"{key}=true"]) == {key: 1}
        assert _changes(KINDS[kind], [f"{key}=3"], [f"{key}=false"]) == {key: -1}


@pytest.mark.parametrize("old, new", sorted(GLOBAL_MICRO_BATCH.items()))
def test_a_global_micro_batch_size_sets_its_own_roles_per_gpu_size_only(old, new):
    """verl's deprecated global size over 2 GPUs is the same config as its own role's
    per-GPU size given as the quotient: no other role's size moves."""
    world = "trainer.n_gpus_per_node=2"
    per_gpu = PPO.flat([world, f"{new}=1"])
    assert per_gpu[new] == 1
    assert PPO.flat([world, f"{new}=null", f"{old}=2"]) == per_gpu, old
