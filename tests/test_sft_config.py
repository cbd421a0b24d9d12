"""`rayrl sft`'s config: verl's SFT names and defaults, checked like `rayrl train`'s
(unknown keys with "did you mean", inert verl keys warned about, the batch split with
its numbers, registry names before Ray starts)."""

from __future__ import annotations

import pytest

from rayrl.config import ConfigError
from rayrl.config.sft import load_sft_config
from rayrl.trainer.names import check_sft_names


def test_defaults_are_verls():
    cfg = load_sft_config()
    d, o, t = cfg.data, cfg.optim, cfg.trainer
    assert (d.prompt_key, d.response_key, d.max_length, d.truncation) == (
        "question",
        "answer",
        1024,
        "error",
    )
    assert (d.train_batch_size, d.micro_batch_size_per_gpu) == (256, 4)
    assert (o.lr, o.betas, o.lr_scheduler, o.lr_warmup_steps_ratio) == (
        1e-5,
        [0.9, 0.95],
        "cosine",
        0.1,
    )
    assert (t.total_epochs, t.seed, t.resume_mode, t.max_ckpt_to_keep) == (4, 1, "auto", None)
    assert cfg.use_remove_padding is False and cfg.model.lora_rank == 0


def test_verl_sft_command_line_loads():
    """The overrides of verl's `examples/sft/gsm8k/run_qwen_05_peft.sh` (paths aside),
    with Hydra's `+` prefix and verl's checkpoint directory key."""
    warnings: list[str] = []
    cfg = load_sft_config(
        None,
        [
            "data.train_files=/data/train.parquet",
            "data.val_files=/data/test.parquet",
            "data.prompt_key=extra_info",
            "data.response_key=extra_info",
            "optim.lr=1e-4",
            "data.prompt_dict_keys=['question']",
            "+data.response_dict_keys=['answer']",
            "data.micro_batch_size_per_gpu=4",
            "model.partial_pretrain=/models/qwen",
            "trainer.default_local_dir=/ckpt/sft",
            "trainer.project_name=gsm8k-sft",
            "trainer.experiment_name=e",
            "trainer.logger=console",
            "trainer.total_epochs=1",
            "model.lora_rank=32",
            "model.lora_alpha=16",
            "model.target_modules=all-linear",
            "ulysses_sequence_parallel_size=2",
            "use_remove_padding=true",
            "trainer.n_gpus_per_node=2",
        ],
        warn=warnings.append,
    )
    assert cfg.data.train_files == ["/data/train.parquet"]
    assert cfg.data.prompt_dict_keys == ["question"] and cfg.data.response_dict_keys == ["answer"]
    assert cfg.trainer.output_dir == "/ckpt/sft" and cfg.trainer.logger == ["console"]
    assert cfg.model.partial_pretrain == "/models/qwen" and cfg.model.lora_rank == 32
    assert cfg.ulysses_sequence_parallel_size == 2 and cfg.dp_size == 1
    assert any("default_local_dir" in w and "trainer.output_dir" in w for w in warnings)


def test_unknown_key_names_the_closest():
    with pytest.raises(ConfigError, match="did you mean 'data.micro_batch_size_per_gpu'"):
        load_sft_config(None, ["data.micro_batch_size_per_gp=4"])
    with pytest.raises(ConfigError, match="did you mean 'model.partial_pretrain'"):
        load_sft_config(None, ["model.partial_pretrained=/m"])
    notes: list[str] = []  # the key of verl's engine SFT trainer (and of rayrl train)
    assert (
        load_sft_config(None, ["model.path=/m"], warn=notes.append).model.partial_pretrain == "/m"
    )
    assert notes == ["model.path='/m' sets model.partial_pretrain: the model to fine-tune"]


def test_batch_split_is_checked_with_numbers():
    with pytest.raises(ConfigError, match=r"256 / 8 ranks = 32 .*micro_batch_size_per_gpu=5"):
        load_sft_config(None, ["data.micro_batch_size_per_gpu=5"])
    with pytest.raises(ConfigError, match="does not split over 8"):
        load_sft_config(None, ["data.train_batch_size=12"])
    load_sft_config(None, ["data.micro_batch_size_per_gpu=5", "data.use_dynamic_bsz=true"])


def test_registry_names_are_checked_before_ray():
    cfg = load_sft_config(None, ["optim.lr_scheduler=cosin"])
    with pytest.raises(ConfigError, match="Did you mean 'cosine'"):
        check_sft_names(cfg)
    cfg = load_sft_config(None, ["data.synthetic_task=largr"])
    with pytest.raises(ConfigError, match="data.synthetic_task='largr'"):
        check_sft_names(cfg)


def test_builtin_demo_config():
    cfg = load_sft_config("demo")
    assert cfg.data.synthetic_task == "larger" and 0 < cfg.data.synthetic_correct_rate < 0.5
    with pytest.raises(ConfigError, match="built-in configs: demo"):
        load_sft_config("no-such-config")


def test_sequence_parallel_size_is_checked_and_takes_verl_engine_spelling():
    """The batch splits over data-parallel ranks (world / Ulysses size); Ulysses needs
    packed rows and a divisor of the world; verl 0.9.1's engine key sets the same."""
    base = ["use_remove_padding=true", "trainer.n_gpus_per_node=8"]
    cfg = load_sft_config(
        None,
        [
            *base,
            "ulysses_sequence_parallel_size=2",
            "data.train_batch_size=256",
            "data.micro_batch_size_per_gpu=64",
        ],
    )
    assert cfg.dp_size == 4  # 256 / 4 = 64 rows a data-parallel rank: one micro-batch
    notes: list[str] = []
    engine = load_sft_config(
        None, [*base, "engine.ulysses_sequence_parallel_size=4"], warn=notes.append
    )
    assert engine.ulysses_sequence_parallel_size == 4
    with pytest.raises(ConfigError, match="set use_remove_padding=true"):
        load_sft_config(None, ["trainer.n_gpus_per_node=2", "ulysses_sequence_parallel_size=2"])
    with pytest.raises(ConfigError, match="ulysses_sequence_parallel_size=3 must .* divide"):
        load_sft_config(None, [*base, "ulysses_sequence_parallel_size=3"])


def test_an_npu_device_is_refused_by_name():
    with pytest.raises(ConfigError, match="Ascend NPUs are not supported"):
        load_sft_config(None, ["trainer.device=npu"])


def test_sft_nulls_read_as_false_on_switches_and_name_the_key_elsewhere():
    """`rayrl sft` takes an unset shell variable's null as `rayrl train` does."""
    warnings = []
    cfg = load_sft_config(
        None,
        ["use_remove_padding=True", "use_remove_padding="],
        validate=False,
        warn=warnings.append,
    )
    assert cfg.use_remove_padding is False and "use_remove_padding" in warnings[0]
    with pytest.raises(ConfigError, match="'optim.lr' is given no value"):
        load_sft_config(None, ["optim.lr="], validate=False)
