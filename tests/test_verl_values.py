"""verl values rayrl now reads as verl does: booleans as save/validation frequencies,
`rayrl sft`'s `after_each_epoch`, `fsdp_size` at or above the world (every rank) and
below it (HSDP) in `rayrl sft`, verl's `file` logger, and verl's SGLang server keys
(no effect, said once)."""

from __future__ import annotations

import json

import pytest

from rayrl.config import ConfigError, load_config
from rayrl.config.layout import MeshSpec
from rayrl.config.sft import load_sft_config
from rayrl.trainer.run import Run
from rayrl.trainer.tracking import Tracking
from rayrl.workers.sft import sft_engine_kwargs


def test_boolean_frequencies_mean_what_verl_makes_of_them():
    """verl tests `freq > 0 and step % freq == 0`: false never, true every step."""
    cfg = load_config("grpo", ["trainer.test_freq=False", "trainer.save_freq=True"])
    assert (cfg.trainer.test_freq, cfg.trainer.save_freq) == (-1, 1)
    sft = load_sft_config("demo", ["trainer.test_freq=false"], warn=lambda m: None)
    assert sft.trainer.test_freq == -1


def test_sft_after_each_epoch_is_the_steps_of_an_epoch():
    cfg = load_sft_config(
        "demo",
        ["trainer.test_freq=after_each_epoch", "trainer.save_freq=after_each_epoch"],
        warn=lambda m: None,
    )
    assert cfg.trainer.test_freq == "after_each_epoch"
    run = Run.__new__(Run)
    run.steps_per_epoch = lambda: 7  # what the run's data gives
    assert run._steps(cfg.trainer.test_freq) == 7 and run._steps(3) == 3
    with pytest.raises(ConfigError, match=r"trainer.test_freq='weekly': a number of steps"):
        load_sft_config("demo", ["trainer.test_freq=weekly"], warn=lambda m: None)
    with pytest.raises(ConfigError, match="trainer.test_freq.*after_each_epoch"):
        load_config("grpo", ["trainer.test_freq=after_each_epoch"])  # verl's PPO: steps only


def test_sft_fsdp_size_shards_in_groups_or_over_every_rank():
    sizes = [
        "trainer.n_gpus_per_node=8",
        "data.train_batch_size=32",
        "data.micro_batch_size_per_gpu=4",
    ]
    sft = load_sft_config("demo", [*sizes, "model.fsdp_config.fsdp_size=2"])
    assert sft_engine_kwargs(sft)["fsdp_size"] == 2  # HSDP: 4 groups of 2
    for size in (8, 16):  # verl: at least the world shards over every rank
        load_sft_config("demo", [*sizes, f"model.fsdp_config.fsdp_size={size}"])
        assert MeshSpec(8, 1, size).shard == 8 and not MeshSpec(8, 1, size).hybrid
    with pytest.raises(ConfigError, match=r"model.fsdp_config.fsdp_size=3 must divide the 8"):
        load_sft_config("demo", [*sizes, "model.fsdp_config.fsdp_size=3"])
    ppo = ["trainer.nnodes=2", "actor_rollout_ref.actor.fsdp_config.fsdp_size=32"]
    assert load_config("grpo", ppo).actor_rollout_ref.ref.fsdp_config.fsdp_size == 32


def test_the_file_logger_writes_verls_lines_at_verls_path(tmp_path, monkeypatch):
    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(tmp_path / "logs"))
    (tmp_path / "run").mkdir()  # the run directory exists before tracking starts
    tracking = Tracking(
        ["console", "file"],
        tmp_path / "run",
        project="p",
        experiment="e",
        config={},
        print_fn=lambda line: None,
    )
    tracking.log({"actor/pg_loss": 0.5, "x": float("nan")}, step=1)
    tracking.finish()
    lines = (tmp_path / "logs" / "p" / "e.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 1, "data": {"actor/pg_loss": 0.5, "x": None}}
    ]


def test_sglang_server_keys_have_no_effect_and_say_so():
    warnings: list[str] = []
    load_config(
        "grpo",
        [
            "actor_rollout_ref.rollout.sglang_rollout_mode=server",
            "actor_rollout_ref.rollout.server.timeout=60",
        ],
        warn=warnings.append,
    )
    assert any("sglang_rollout_mode='server'" in w and "no effect" in w for w in warnings)
    assert any("server.timeout=60" in w and "no effect" in w for w in warnings)
