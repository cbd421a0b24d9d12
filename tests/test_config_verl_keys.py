"""verl 0.9.1's own configs, key by key: every leaf of its `_generated_ppo_trainer.yaml`
(`rayrl train`) and of its SFT trainer's config (`rayrl sft`), set alone to verl's
default, is taken: it lands on a rayrl key with that value, or it is dropped with one
warning that names it and says why it has no effect (or, for a value that asks for
nothing rayrl lacks, silently). The whole file at once loads too. Values that ask
for a missing feature are refused with its name; verl's other spellings of a key
mean the same as rayrl's; its deprecated global micro-batch sizes become per-GPU ones.

The key lists (`tests/data/verl_0.9.1_*_keys.jsonl`) are the leaves of verl 0.9.1's
config files (Apache-2.0) with interpolations resolved: `???` (no default) is `vllm`
for the rollout name, `_target_` keys are left out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rayrl.config import ConfigError, load_config, to_yaml
from rayrl.config.compat import Only, rule_table, verl_ppo, verl_sft
from rayrl.config.compat.rules import flatten
from rayrl.config.load import parse_overrides, source_data
from rayrl.config.schema import RayRLConfig
from rayrl.config.sft import SFTConfig, load_sft_config, sft_source_data

DATA = Path(__file__).resolve().parent / "data"
PPO_KEYS = [json.loads(line) for line in (DATA / "verl_0.9.1_ppo_keys.jsonl").open()]
SFT_KEYS = [json.loads(line) for line in (DATA / "verl_0.9.1_sft_keys.jsonl").open()]
PPO_TABLE = rule_table(verl_ppo.RULES, RayRLConfig)
SFT_TABLE = rule_table(verl_sft.RULES, SFTConfig)
MICRO = [
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
    "critic.ppo_micro_batch_size_per_gpu=4",
]
# verl values that rayrl stores in another form
STORED_AS = {
    ("actor_rollout_ref.rollout.name", "vllm"): "auto",
}


def override(key: str, value) -> str:
    return f"{key}={json.dumps(value)}"


def get(tree: dict, path: str):
    for part in path.split("."):
        tree = tree[part]
    return tree


def silently_dropped(table, key: str, value) -> bool:
    """Whether `key=value` is meant to vanish without a word: a verl `null` meaning
    "not set", or a value of an `Only` rule that asks for nothing rayrl lacks."""
    moved = table.match(key, moved=True)
    if moved is not None and moved[0] == key and value in moved[1].unset:
        return True
    target = key
    while (found := table.match(target, moved=True)) is not None and found[1].target != found[0]:
        target = found[1].target + target[len(found[0]) :]
    rule = table.match(target, moved=False)
    return rule is not None and isinstance(rule[1], Only) and rule[1].note is None


def check_alone(key: str, default, table, source_data_fn) -> None:
    messages: list[str] = []
    data = source_data_fn(parse_overrides([override(key, default)]), "test", messages.append)
    named = [m for m in messages if key in m]
    assert len(named) <= 1, named
    landed = flatten(data)
    if named and "no effect in rayrl: " in named[0]:
        assert landed == [], (key, landed)
        assert named[0].split("no effect in rayrl: ", 1)[1].strip()
        return
    if not landed:
        assert silently_dropped(table, key, default), f"{key} vanished without a warning"
        return
    for path, _ in landed:  # a group default lands leaf by leaf
        assert table.in_schema(path), (key, path)
    if not isinstance(default, dict):
        ((path, value),) = landed
        expected = STORED_AS.get((key, default), default) if isinstance(default, str) else default
        assert value == expected, (key, path, value)


def by_group(rows: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["key"].split(".")[0], []).append(row)
    return groups


def failures(rows: list[dict], table, source_data_fn) -> list[str]:
    """Each key of `rows` set alone to its default; what went wrong, key by key."""
    found = []
    for row in rows:
        try:
            check_alone(row["key"], row["default"], table, source_data_fn)
        except (AssertionError, ConfigError) as exc:
            found.append(f"{row['key']}={row['default']!r}: {exc}")
    return found


PPO_GROUPS, SFT_GROUPS = by_group(PPO_KEYS), by_group(SFT_KEYS)


@pytest.mark.parametrize("group", sorted(PPO_GROUPS))
def test_each_verl_ppo_key_alone_at_its_default(group):
    failed = failures(PPO_GROUPS[group], PPO_TABLE, source_data)
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("group", sorted(SFT_GROUPS))
def test_each_verl_sft_key_alone_at_its_default(group):
    failed = failures(SFT_GROUPS[group], SFT_TABLE, sft_source_data)
    assert not failed, "\n".join(failed)


def test_the_lists_are_verls_whole_configs():
    assert len(PPO_KEYS) == 829 and len(SFT_KEYS) == 180
    keys = {r["key"] for r in PPO_KEYS}
    for key in ("reward.reward_manager.name", "trainer.log_val_generations", "data.seed"):
        assert key in keys


def _nested(rows: list[dict]) -> dict:
    tree: dict = {}
    for row in rows:
        *groups, leaf = row["key"].split(".")
        node = tree
        for group in groups:
            node = node.setdefault(group, {})
        node[leaf] = row["default"]
    return tree


def test_verls_whole_ppo_config_as_a_file_loads_with_its_values(tmp_path):
    """`rayrl train -c verl_config.yaml` with every key of verl 0.9.1's config at its
    default (micro-batch sizes given: verl requires them too)."""
    path = tmp_path / "verl.yaml"
    path.write_text(yaml.safe_dump(_nested(PPO_KEYS)))
    messages: list[str] = []
    cfg = load_config(path, MICRO, warn=messages.append)
    arr = cfg.actor_rollout_ref
    assert cfg.trainer.output_dir == os.path.abspath(
        "checkpoints/verl_examples/gsm8k"
    )  # default_local_dir
    assert cfg.trainer.val_examples == 0  # log_val_generations
    assert cfg.reward.num_workers == 8 and cfg.reward.reward_manager.name == "naive"
    assert arr.rollout.max_num_seqs == 256 and arr.actor.clip_ratio_high == 0.2
    assert cfg.trainer.logger == ["console", "wandb"] and arr.rollout.calculate_log_probs
    # one warning per rule and group: global_profiler's inert keys in one, each inert key once
    assert sum(m.startswith("global_profiler.") for m in messages) == 1
    for key in ("actor_rollout_ref.rollout.mode", "trainer.use_v1", "data.audio_key"):
        assert sum(f"{key}=" in m for m in messages) == 1
    assert (cfg.data.image_key, cfg.data.video_key) == ("images", "videos")  # schema keys


def test_verls_whole_sft_config_as_a_file_loads(tmp_path):
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(_nested(SFT_KEYS)))
    cfg = load_sft_config(
        path, ["trainer.n_gpus_per_node=1", "data.train_files=[]"], warn=lambda m: None
    )
    assert cfg.model.partial_pretrain == "~/models/deepseek-llm-7b-chat"  # model.path
    assert cfg.optim.lr_scheduler == "constant" and cfg.optim.lr == pytest.approx(1e-3)
    assert cfg.use_remove_padding is True and cfg.data.use_dynamic_bsz is True


def _other_value(value):
    if isinstance(value, bool):
        return not value
    if value is None or value == {}:
        return "something"
    if isinstance(value, int | float):
        return value + 3
    if isinstance(value, str):
        return value + "_other"
    return ["something"]


ONLY = [
    r
    for r in PPO_KEYS
    if (m := PPO_TABLE.match(r["key"], moved=False)) is not None
    and isinstance(m[1], Only)
    and not PPO_TABLE.in_schema(r["key"])
    and not isinstance(r["default"], dict)
]


@pytest.mark.parametrize("row", ONLY, ids=[r["key"] for r in ONLY])
def test_a_value_that_asks_for_a_missing_feature_is_refused_by_name(row):
    key = row["key"]
    feature = PPO_TABLE.match(key, moved=False)[1].feature
    with pytest.raises(ConfigError, match="rayrl does not support") as err:
        source_data(parse_overrides([override(key, _other_value(row["default"]))]), "t", print)
    assert key in str(err.value) and feature in str(err.value)


def test_keys_verls_scripts_set_outside_its_config_load_with_a_warning():
    """`model.torch_dtype` (verl's CISPO example; verl never reads it) and
    `+trainer.rl_logging_board_dir` (a recipe's) have no effect and say so."""
    said = []
    data = source_data(
        parse_overrides(["actor_rollout_ref.model.torch_dtype=bfloat16"]), "t", said.append
    )
    assert "torch_dtype" not in data.get("actor_rollout_ref", {}).get("model", {})
    assert any("model.torch_dtype" in line and "never reads it" in line for line in said)
    load_config(None, [*MICRO, "actor_rollout_ref.model.torch_dtype=bfloat16"])
    said.clear()
    source_data(parse_overrides(["+trainer.rl_logging_board_dir=/tmp/board"]), "t", said.append)
    assert any("rl_logging_board_dir" in line and "neither verl nor rayrl" in line for line in said)


def test_megatron_is_refused_with_its_name():
    with pytest.raises(ConfigError, match="Megatron-LM training"):
        load_config(None, [*MICRO, "actor_rollout_ref.actor.strategy=megatron"])
    with pytest.raises(ConfigError, match="Megatron-LM training"):
        load_config(
            None, [*MICRO, "+actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"]
        )


def _resolved(overrides: list[str]) -> str:
    return to_yaml(load_config("grpo", overrides, warn=lambda m: None))


@pytest.mark.parametrize(
    "verl, rayrl",
    [
        (  # verl 0.9.1's reward section and the older top-level groups
            [
                "reward.custom_reward_function.path=/r.py",
                "reward.custom_reward_function.name=score",
                "reward.reward_model.enable=true",
                "reward.reward_model.model_path=/rm",
                "reward.reward_manager.name=dapo",
                "reward.num_workers=3",
                "+reward.reward_kwargs.overlong_buffer_cfg.enable=true",
                "+reward.reward_kwargs.overlong_buffer_cfg.len=8",
                "+reward.reward_kwargs.max_resp_len=32",
            ],
            [
                "custom_reward_function.path=/r.py",
                "custom_reward_function.name=score",
                "reward_model.enable=true",
                "reward_model.model.path=/rm",
                "reward_model.reward_manager=dapo",
                "reward_model.num_workers=3",
                "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=true",
                "+reward_model.reward_kwargs.overlong_buffer_cfg.len=8",
                "+reward_model.reward_kwargs.max_resp_len=32",
            ],
        ),
        (["reward.reward_manager.name=batch"], ["reward_model.reward_manager=batch"]),
        (
            ["reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=8"],
            [
                "+reward.reward_kwargs.overlong_buffer_cfg.enable=true",
                "+reward.reward_kwargs.overlong_buffer_cfg.len=8",
            ],
        ),
        (["critic.fsdp.param_offload=true"], ["critic.model.fsdp_config.param_offload=true"]),
        (
            ["actor_rollout_ref.actor.grad_clip=0.5"],
            ["actor_rollout_ref.actor.optim.clip_grad=0.5"],
        ),
        (
            ["actor_rollout_ref.actor.optim.warmup_style=cosine"],
            ["actor_rollout_ref.actor.optim.lr_scheduler_type=cosine"],
        ),
        (["trainer.default_local_dir=/ckpt/x"], ["trainer.output_dir=/ckpt/x"]),
        (["trainer.log_val_generations=3"], ["trainer.val_examples=3"]),
        (["actor_rollout_ref.rollout.response_length=24"], ["data.max_response_length=24"]),
        (  # verl's PrefixGrouper is rayrl's shared-prompt training
            ["actor_rollout_ref.actor.use_prefix_grouper=true"],
            ["actor_rollout_ref.model.share_prompts=true"],
        ),
        (  # verl's global sizes (samples on all GPUs; grpo.yaml: 1 GPU) and per-GPU ones
            [
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null",
                "actor_rollout_ref.actor.ppo_micro_batch_size=2",
                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=null",
                "actor_rollout_ref.rollout.log_prob_micro_batch_size=4",
            ],
            [
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
            ],
        ),
    ],
)
def test_both_spellings_give_the_same_config(verl, rayrl):
    assert _resolved(verl) == _resolved(rayrl) != _resolved([])


def test_two_spellings_of_one_key_with_different_values_are_refused():
    with pytest.raises(ConfigError, match="set the same key"):
        load_config(
            "grpo",
            ["actor_rollout_ref.actor.grad_clip=0.5", "actor_rollout_ref.actor.optim.clip_grad=2"],
        )


def test_clip_ratio_sets_the_bounds_that_are_not_set():
    a = load_config("grpo", ["actor_rollout_ref.actor.clip_ratio=0.3"]).actor_rollout_ref.actor
    assert (a.clip_ratio_low, a.clip_ratio_high) == (0.3, 0.3)
    a = load_config(
        "grpo",
        ["actor_rollout_ref.actor.clip_ratio=0.3", "actor_rollout_ref.actor.clip_ratio_high=0.28"],
    ).actor_rollout_ref.actor
    assert (a.clip_ratio_low, a.clip_ratio_high) == (0.3, 0.28)


def test_global_micro_batch_sizes_follow_verls_rule_with_a_note():
    notes: list[str] = []
    cfg = load_config(
        None,
        [
            "trainer.n_gpus_per_node=8",
            "actor_rollout_ref.actor.ppo_micro_batch_size=64",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size=128",
            "critic.ppo_micro_batch_size=32",
        ],
        warn=notes.append,
    )
    arr = cfg.actor_rollout_ref
    assert arr.actor.ppo_micro_batch_size_per_gpu == 8  # 64 // 8 GPUs, as verl divides
    assert arr.rollout.log_prob_micro_batch_size_per_gpu == 16
    assert cfg.critic.ppo_micro_batch_size_per_gpu == 4
    assert cfg.critic.forward_micro_batch_size_per_gpu == 4  # follows, as in verl
    assert any("64 // 8 GPUs = 8 per GPU" in n for n in notes)
    with pytest.raises(ConfigError, match="are both set"):
        load_config("grpo", ["actor_rollout_ref.actor.ppo_micro_batch_size=8"])
    with pytest.raises(ConfigError, match="= 0 per GPU"):
        load_config(None, ["actor_rollout_ref.actor.ppo_micro_batch_size=4", *MICRO[1:]])


def test_fsdp_size_is_a_divisor_of_the_world_or_refused_by_name():
    """verl's fsdp_size: -1 (all ranks) or a sharding group size dividing the world
    (hybrid sharding); anything else is refused naming the key."""
    for size in (-1, 1):
        load_config("grpo", [f"actor_rollout_ref.actor.fsdp_config.fsdp_size={size}"])
    load_config(
        "grpo", ["trainer.n_gpus_per_node=4", "actor_rollout_ref.ref.fsdp_config.fsdp_size=2"]
    )
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.ref.fsdp_config.fsdp_size=3"):
        load_config(
            "grpo", ["trainer.n_gpus_per_node=4", "actor_rollout_ref.ref.fsdp_config.fsdp_size=3"]
        )


def test_rollout_correction_needs_the_rollouts_log_probs():
    load_config("grpo", ["actor_rollout_ref.rollout.calculate_log_probs=false"])
    with pytest.raises(ConfigError, match="calculate_log_probs=false"):
        load_config(
            "grpo",
            [
                "actor_rollout_ref.rollout.calculate_log_probs=false",
                "algorithm.rollout_correction.rollout_is=token",
            ],
        )


def test_a_malformed_value_is_a_config_error_naming_key_and_text(tmp_path):
    """As a user types it: exit 2, the key and the text, no traceback."""
    done = subprocess.run(
        [sys.executable, "-m", "rayrl.cli.main", "config", "show", 'trainer.logger=["console",'],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ,
    )
    assert done.returncode == 2, done.stderr
    assert "config error" in done.stderr and "Traceback" not in done.stderr
    assert "'trainer.logger'" in done.stderr and '["console",' in done.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  seed: [1\n")
    with pytest.raises(ConfigError, match="bad.yaml is not a valid YAML config"):
        load_config(bad)


def test_calculate_log_probs_reports_how_far_rollout_and_actor_probabilities_are():
    """What `rollout.calculate_log_probs` turns on: verl's training/rollout_probs_diff_*."""
    import torch

    from rayrl.algos.probs_diff import probs_diff_rows
    from rayrl.batch import Batch
    from rayrl.trainer.metrics import rollout_probs_diff

    actor = torch.log(torch.tensor([[0.5, 0.25, 0.9], [0.1, 0.2, 0.3]]))
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    same = Batch({"rollout_log_probs": actor, "old_log_probs": actor, "response_mask": mask})
    metrics = rollout_probs_diff(same, same)  # from the token columns
    assert metrics["training/rollout_probs_diff_max"] == 0.0
    assert metrics["training/rollout_actor_probs_pearson_corr"] == pytest.approx(1.0)
    shifted = torch.log(torch.tensor([[0.6, 0.25, 0.1], [0.1, 0.2, 0.3]]))
    off = Batch({"rollout_log_probs": shifted, "old_log_probs": actor, "response_mask": mask})
    metrics = rollout_probs_diff(off, off)  # the masked 0.9 vs 0.1 does not count
    assert metrics["training/rollout_probs_diff_max"] == pytest.approx(0.1)
    assert metrics["training/rollout_probs_diff_mean"] == pytest.approx(0.1 / 5)
    # the log-prob pass's per-row sums (rows on the workers) give the same figures
    sums = Batch(probs_diff_rows(shifted, actor, mask))
    lengths = Batch({"response_length": mask.sum(-1)})
    assert rollout_probs_diff(sums, lengths) == pytest.approx(metrics)
    std = (torch.tensor([0.1, 0, 0, 0, 0]).std()).item()  # torch.std, as verl's
    assert metrics["training/rollout_probs_diff_std"] == pytest.approx(std)
    assert metrics["training/rollout_probs_diff_valid"] == 1
    none = Batch({**off.tensors, "response_mask": torch.zeros_like(mask)})
    assert rollout_probs_diff(none, none) == {"training/rollout_probs_diff_valid": 0.0}


def test_rollout_probs_metrics_from_row_sums_equal_verls_whole_batch_formulas():
    """On random probabilities and masks, the per-row sums give what verl's
    `calculate_debug_metrics` computes over the masked tokens: torch.max, torch.mean,
    torch.std (Bessel's correction) of |p_rollout - p_actor| and torch.corrcoef."""
    import torch

    from rayrl.algos.probs_diff import probs_diff_metrics, probs_diff_rows

    gen = torch.Generator().manual_seed(3)
    for rows, cols in [(6, 9), (1, 2), (32, 17)]:
        rollout = torch.rand(rows, cols, generator=gen).clamp_min(1e-3).log()
        actor = torch.rand(rows, cols, generator=gen).clamp_min(1e-3).log()
        mask = torch.rand(rows, cols, generator=gen) < 0.7
        mask[0, 0] = mask[0, 1] = True  # two real tokens at least
        p_rollout, p_actor = rollout.exp()[mask], actor.exp()[mask]
        diff = (p_actor - p_rollout).abs()
        verl = {
            "training/rollout_probs_diff_valid": 1.0,
            "training/rollout_probs_diff_max": diff.max().item(),
            "training/rollout_probs_diff_mean": diff.mean().item(),
            "training/rollout_probs_diff_std": diff.std().item(),
            "training/rollout_actor_probs_pearson_corr": torch.corrcoef(
                torch.stack([p_actor, p_rollout])
            )[0, 1].item(),
        }
        ours = probs_diff_metrics(probs_diff_rows(rollout, actor, mask), mask.sum(-1))
        assert ours == pytest.approx(verl, rel=1e-5, abs=1e-6), (rows, cols)
