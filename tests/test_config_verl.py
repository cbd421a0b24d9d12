"""verl command lines work as they are: each example script's overrides pass
`rayrl config show` (only the program name and the paths differ), with verl's meaning."""

from __future__ import annotations

import re
import shlex

import pytest

from rayrl.cli.main import main
from rayrl.config import load_config
from verl_examples import SCRIPTS

ASSIGN = re.compile(r'^(\w+)=(?:"([^"]*)"|\$\{(\w+):-([^}]*)\}|(\S*))\s*(#.*)?$')


def verl_overrides(script: str, home: str) -> list[str]:
    """The `key=value` arguments of the script's trainer command, after shell expansion."""
    env = {"HOME": home}
    for line in script.splitlines():
        m = ASSIGN.match(line.strip())
        if m:
            quoted, var, default, plain = m.group(2), m.group(3), m.group(4), m.group(5)
            value = quoted if quoted is not None else plain
            if var is not None:
                value = env.get(var, default)
            env[m.group(1)] = re.sub(r"\$(\w+)", lambda v: env.get(v.group(1), ""), value)
    command = script[script.index("python3 -m verl.trainer.main_ppo") :].replace("\\\n", " ")
    command = command.replace("$@", "")
    command = re.sub(r"\$\{?(\w+)\}?", lambda v: env[v.group(1)], command)
    return [arg for arg in shlex.split(command) if "=" in arg]


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_verl_example_passes_config_show(name, tmp_path, capsys):
    args = verl_overrides(SCRIPTS[name], str(tmp_path))
    assert len(args) >= 30
    assert main(["config", "show", *args]) == 0, capsys.readouterr().err
    out = capsys.readouterr()
    assert "config error" not in out.err
    assert str(tmp_path / "data/gsm8k/train.parquet") in out.out


def test_verl_meaning_of_a_grpo_line(tmp_path):
    script = SCRIPTS["examples/grpo_trainer/run_qwen2_5-3b_gsm8k_grpo_lora.sh"]
    with pytest.warns(UserWarning) as caught:
        cfg = load_config(None, verl_overrides(script, str(tmp_path)))
    warned = " ".join(str(w.message) for w in caught)
    for key in ("load_format", "layered_summon", "rollout.name"):
        assert key in warned
    assert "tensor_model_parallel_size" not in warned  # verl's key takes effect
    arr = cfg.actor_rollout_ref
    assert cfg.data.train_files == [str(tmp_path / "data/gsm8k/train.parquet")]
    assert (arr.model.lora_rank, arr.model.lora_alpha) == (64, 32)
    assert arr.rollout.name == "auto" and arr.rollout.n == 5
    assert arr.rollout.tensor_model_parallel_size == 2
    assert arr.actor.fsdp_config.param_offload is False
    assert arr.ref.fsdp_config.param_offload is True
    assert cfg.trainer.logger == ["console", "wandb"]
    assert cfg.trainer.total_epochs == 15 and cfg.trainer.total_training_steps is None
    # verl's defaults where the line is silent
    assert arr.actor.clip_ratio_low == 0.2 and arr.actor.ppo_epochs == 1
    assert arr.actor.optim.weight_decay == 0.01 and arr.model.enable_gradient_checkpointing


def test_verl_meaning_of_a_ppo_line(tmp_path):
    script = SCRIPTS["examples/ppo_trainer/run_qwen2-7b_seq_balance.sh"]
    with pytest.warns(UserWarning, match="return_raw_chat"):
        cfg = load_config(None, verl_overrides(script, str(tmp_path)))
    arr, critic = cfg.actor_rollout_ref, cfg.critic
    assert cfg.data.train_files == [
        str(tmp_path / "data/gsm8k/train.parquet"),
        str(tmp_path / "data/math/train.parquet"),
    ]
    assert arr.actor.ppo_max_token_len_per_gpu == 24000
    assert arr.rollout.log_prob_max_token_len_per_gpu == 24000
    # the critic follows the actor where verl says so
    assert critic.ppo_mini_batch_size == 512 and critic.use_dynamic_bsz
    assert critic.ppo_max_token_len_per_gpu == 98304
    assert critic.forward_max_token_len_per_gpu == 98304
    assert critic.optim.lr == pytest.approx(1e-5)


def test_verl_defaults():
    cfg = load_config(
        None,
        [
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
            "critic.ppo_micro_batch_size_per_gpu=4",
        ],
    )
    d, a = cfg.data, cfg.actor_rollout_ref
    assert (d.max_prompt_length, d.max_response_length, d.train_batch_size) == (512, 512, 1024)
    assert d.filter_overlong_prompts is False and d.truncation == "error"
    assert a.actor.ppo_mini_batch_size == 256 and a.actor.optim.lr == pytest.approx(1e-6)
    assert a.rollout.n == 1 and a.rollout.val_kwargs.temperature == 0
    assert cfg.algorithm.adv_estimator == "gae" and cfg.trainer.n_gpus_per_node == 8


def test_file_lists_and_logger_accept_a_string_or_a_list():
    base = ["-c", "grpo"]
    cfg = load_config("grpo", ["data.train_files=/d/a.parquet", "trainer.logger=console"])
    assert cfg.data.train_files == ["/d/a.parquet"] and cfg.trainer.logger == ["console"]
    cfg = load_config("grpo", ["data.train_files=[/d/a.parquet,/d/b.parquet]"])
    assert cfg.data.train_files == ["/d/a.parquet", "/d/b.parquet"]
    assert main(["config", "show", *base, "data.val_files=/d/v.parquet"]) == 0
