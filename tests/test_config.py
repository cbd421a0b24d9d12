"""Config: defaults, YAML, dotted overrides, unknown keys with suggestions, batch-size rules."""

from __future__ import annotations

import pytest
import torch

from rayrl.cli.main import main
from rayrl.config import ConfigError, RayRLConfig, load_config, to_yaml


def test_builtin_grpo_describes_the_demo():
    cfg = load_config("grpo")
    assert isinstance(cfg, RayRLConfig)
    assert cfg.actor_rollout_ref.model.path is None  # the demo builds its tiny model
    assert cfg.algorithm.adv_estimator == "grpo"
    assert cfg.world_size == 1


def test_no_config_means_verl_defaults_and_says_what_is_missing():
    with pytest.raises(ConfigError, match="ppo_micro_batch_size_per_gpu is not set"):
        load_config()


def test_builtin_yaml_and_overrides_are_typed():
    cfg = load_config(
        "grpo",
        [
            "actor_rollout_ref.actor.optim.lr=1e-6",
            "trainer.seed=7",
            "trainer.logger=[console,tensorboard]",
        ],
    )
    assert cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(1e-6)
    assert isinstance(cfg.actor_rollout_ref.actor.optim.lr, float)
    assert cfg.trainer.seed == 7
    assert cfg.trainer.logger == ["console", "tensorboard"]
    assert load_config("ppo").algorithm.adv_estimator == "gae"


def test_yaml_file_then_overrides_win(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  seed: 3\n  total_training_steps: 10\n")
    cfg = load_config(path, ["trainer.seed=4"], validate=False)
    assert (cfg.trainer.seed, cfg.trainer.total_training_steps) == (4, 10)


@pytest.mark.parametrize(
    "override, bad, hint",
    [
        (
            "actor_rollout_ref.actor.optim.lrr=1",
            "actor_rollout_ref.actor.optim.lrr",
            "actor_rollout_ref.actor.optim.lr",
        ),
        ("trainer.sed=1", "trainer.sed", "trainer.seed"),
        ("actor.optim.lr=1", "actor", "actor_rollout_ref.actor.optim.lr"),
        ("seed=3", "seed", "data.seed' or 'trainer.seed"),
        (
            "actor_rollout_ref.rollout.temprature=0.5",
            "actor_rollout_ref.rollout.temprature",
            "actor_rollout_ref.rollout.temperature",
        ),
    ],
)
def test_unknown_key_names_key_and_suggestion(override, bad, hint):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert f"unknown config key '{bad}'" in str(err.value)
    assert f"did you mean '{hint}'" in str(err.value)


def test_unknown_key_in_yaml_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("data:\n  train_batch_sise: 8\n")
    with pytest.raises(
        ConfigError, match=r"data.train_batch_sise.*bad.yaml.*data.train_batch_size"
    ):
        load_config(path)


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigError, match="trainer.seed"):
        load_config(None, ["trainer.seed=abc"])
    with pytest.raises(ConfigError, match="'trainer' is a group"):
        load_config(None, ["trainer=3"])
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["trainer.seed"])


def test_missing_file_lists_builtins():
    with pytest.raises(ConfigError, match="grpo, ppo"):
        load_config("no-such-file.yaml")


def test_prompts_must_split_into_mini_batches():
    with pytest.raises(
        ConfigError, match=r"train_batch_size=6 .*ppo_mini_batch_size=4 .*6 % 4 = 2"
    ):
        load_config("grpo", ["data.train_batch_size=6"])


def test_mini_batch_must_split_over_ranks():
    # 4 prompts x 4 samples = 16 samples over 3 ranks
    with pytest.raises(ConfigError, match=r"16 samples does not split over 3 .*16 % 3 = 1"):
        load_config("grpo", ["trainer.n_gpus_per_node=3"])
    load_config(
        "grpo",
        [
            "trainer.n_gpus_per_node=2",
            "trainer.nnodes=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        ],
    )


def test_rank_share_must_split_into_micro_batches():
    # 16 samples / 2 ranks = 8 per rank, micro-batch 3
    with pytest.raises(
        ConfigError, match=r"16 samples / 2 ranks = 8.*micro_batch_size_per_gpu=3.*8 % 3 = 2"
    ):
        load_config(
            "grpo",
            ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"],
        )
    # dynamic batch sizes lift the micro-batch rule
    load_config(
        "grpo",
        [
            "trainer.n_gpus_per_node=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
        ],
    )


def test_critic_chain_checked_only_when_critic_runs():
    bad_critic = ["critic.ppo_micro_batch_size_per_gpu=3"]
    load_config("grpo", bad_critic)  # grpo: no critic
    with pytest.raises(ConfigError, match=r"critic.ppo_micro_batch_size_per_gpu=3"):
        load_config("ppo", bad_critic)


def test_grpo_with_one_sample_warns_and_choices_are_checked():
    """rollout.n=1 with a group estimator loads, as in verl (each sample's advantage is
    its score: `grpo_advantages` of one-sample groups), with a warning."""
    from rayrl.algos.advantages import grpo_advantages
    from rayrl.config.errors import ConfigWarning

    with pytest.warns(ConfigWarning, match="rollout.n=1: each group holds one sample"):
        load_config("grpo", ["actor_rollout_ref.rollout.n=1"])
    scores = torch.zeros(3, 4)
    scores[:, -1] = torch.tensor([0.5, -1.0, 2.0])
    advantages, _ = grpo_advantages(scores, torch.ones(3, 4), ["a", "b", "c"])
    torch.testing.assert_close(advantages[:, 0], torch.tensor([0.5, -1.0, 2.0]), atol=1e-5, rtol=0)
    with pytest.raises(ConfigError, match="truncation='middle' is not one of error, left, right"):
        load_config("grpo", ["data.truncation=middle"])
    with pytest.raises(ConfigError, match="capacity_factor=0.5"):
        load_config("grpo", ["resources.capacity_factor=0.5"])


def test_cli_config_show(capsys):
    assert main(["config", "show", "-c", "grpo", "trainer.seed=11"]) == 0
    out = capsys.readouterr().out
    assert "seed: 11" in out and "adv_estimator: grpo" in out
    assert to_yaml(load_config("grpo", ["trainer.seed=11"])) == out


def test_cli_config_show_error_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["config", "show", "trainer.sed=1"])
    assert exc.value.code == 2
    assert "did you mean 'trainer.seed'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "override, hint",
    [
        ("algorithm.adv_estimator=grp0", "grpo"),
        ("actor_rollout_ref.actor.policy_loss.loss_mode=gsop", "gspo"),
        ("actor_rollout_ref.actor.kl_loss_type=low_var_k", "low_var_kl"),
        ("algorithm.kl_penalty=k33", "k3"),
        ("algorithm.kl_ctrl.type=adaptiv", "adaptive"),
        ("actor_rollout_ref.actor.loss_agg_mode=token_mean", "token-mean"),
        ("critic.loss_agg_mode=seq-mean-tokenmean", "seq-mean-token-mean"),
        ("actor_rollout_ref.rollout.name=hff", "hf"),
        ("trainer.logger=[console,tensorbord]", "tensorboard"),
        ("actor_rollout_ref.actor.optim.lr_scheduler_type=cosin", "cosine"),
    ],
)
def test_registry_names_are_checked_at_load_with_did_you_mean(override, hint, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["config", "show", "-c", "grpo", override])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    key = override.split("=")[0]
    assert f"{key}=" in err and f"Did you mean '{hint}'" in err


def test_bad_name_refused_before_ray_starts_in_seconds(tmp_path):
    """`rayrl train` with a misspelt estimator exits at config load, before Ray starts.
    Measured in CPU seconds of the child process (imports included), which a loaded
    shared machine does not inflate as it does wall time."""
    import os
    import resource
    import subprocess
    import sys

    ray_dir = tmp_path / "ray"  # a Ray start would create its session here
    env = {**os.environ, "RAY_TMPDIR": str(ray_dir)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rayrl.cli.main",
            "train",
            "-c",
            "grpo",
            "algorithm.adv_estimator=grp0",
            f"trainer.output_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert proc.returncode == 2, proc.stderr
    assert "Did you mean 'grpo'" in proc.stderr
    assert not ray_dir.exists()
    assert cpu_s < 10, f"refusing a bad name took {cpu_s:.1f} CPU seconds"


def test_verl_keys_without_effect_warn_one_line_each(capsys):
    assert (
        main(
            [
                "config",
                "show",
                "-c",
                "grpo",
                "actor_rollout_ref.rollout.data_parallel_size=2",
                "actor_rollout_ref.rollout.name=vllm",
            ]
        )
        == 0
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2
    assert "data_parallel_size=2 has no effect in rayrl" in err[0]
    assert "rollout.name=vllm" in err[1] and "'auto'" in err[1]


def test_no_config_runs_the_demo_unless_a_model_or_data_is_named(capsys):
    # Every command that takes a config works with none (the demo's config);
    # naming a model or train files starts from verl's defaults instead.
    assert main(["config", "show"]) == 0
    captured = capsys.readouterr()
    assert "train_batch_size: 8\n" in captured.out and "demo config 'grpo'" in captured.err
    verl = ["actor_rollout_ref.actor.use_dynamic_bsz=true", "critic.use_dynamic_bsz=true"]
    assert main(["config", "show", "data.train_files=/d/train.parquet", *verl]) == 0
    captured = capsys.readouterr()
    assert "train_batch_size: 1024\n" in captured.out and "demo config" not in captured.err


def test_rollout_tensor_parallel_size_must_fit_a_node_or_whole_nodes():
    key = "actor_rollout_ref.rollout.tensor_model_parallel_size"
    assert load_config("grpo").actor_rollout_ref.rollout.tensor_model_parallel_size == 1
    cfg = load_config("grpo", [f"{key}=2", "trainer.n_gpus_per_node=4"])
    assert cfg.actor_rollout_ref.rollout.tensor_model_parallel_size == 2
    with pytest.raises(ConfigError, match="tensor_model_parallel_size=3 must .* divide"):
        load_config("grpo", [f"{key}=3", "trainer.n_gpus_per_node=4"])
    # Replicas of whole nodes, as verl's (a 70B model at TP=16 on nodes of 8 GPUs).
    nodes = ["trainer.n_gpus_per_node=8", "trainer.nnodes=4", "data.train_batch_size=32"]
    nodes += ["actor_rollout_ref.actor.ppo_mini_batch_size=32"]
    assert load_config("grpo", [f"{key}=16", *nodes]).world_size == 32
    for tp, nnodes in ((12, 4), (16, 3)):  # not whole nodes; not dividing the ranks
        with pytest.raises(ConfigError, match=f"tensor_model_parallel_size={tp} must"):
            load_config(
                "grpo", [f"{key}={tp}", "trainer.n_gpus_per_node=8", f"trainer.nnodes={nnodes}"]
            )


def test_a_null_switch_reads_as_false_with_a_warning(tmp_path):
    """`key=${UNSET}` passes a null: on a yes/no key it reads as false (as verl reads
    it; one of verl's multi-turn examples does this), whatever came before, with a
    warning naming the key; in a YAML file too."""
    warnings = []
    cfg = load_config(
        "grpo",
        ["actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.use_kl_loss="],
        validate=False,
        warn=warnings.append,
    )
    assert cfg.actor_rollout_ref.actor.use_kl_loss is False
    assert len(warnings) == 1 and "actor_rollout_ref.actor.use_kl_loss" in warnings[0]
    assert "unset shell variable" in warnings[0]
    path = tmp_path / "c.yaml"
    path.write_text("actor_rollout_ref:\n  actor:\n    use_kl_loss: null\n")
    warnings.clear()
    assert (
        load_config(path, validate=False, warn=warnings.append).actor_rollout_ref.actor.use_kl_loss
        is False
    )
    assert str(path) in warnings[0]


def test_a_null_on_a_number_names_the_key_and_the_likely_cause():
    with pytest.raises(ConfigError) as err:
        load_config("grpo", ["actor_rollout_ref.actor.ppo_max_token_len_per_gpu="])
    message = str(err.value)
    assert "'actor_rollout_ref.actor.ppo_max_token_len_per_gpu' is given no value" in message
    assert "an integer" in message and "shell variable" in message
    assert "Incompatible" not in message
    # a key that may be null stays null, with no warning
    warnings = []
    cfg = load_config(
        "grpo", ["actor_rollout_ref.actor.ppo_micro_batch_size="], warn=warnings.append
    )
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size is None
    assert not [w for w in warnings if "no value" in w]


def test_share_prompts_takes_true_false_or_auto_and_the_critic_follows():
    cfg = load_config("grpo")
    assert cfg.actor_rollout_ref.model.share_prompts == "auto"
    assert cfg.critic.model.share_prompts == "auto"
    off = load_config("grpo", ["actor_rollout_ref.model.share_prompts=false"])
    assert off.critic.model.share_prompts is False
    with pytest.raises(ConfigError, match="model.share_prompts='maybe': use true, false or auto"):
        load_config("grpo", ["actor_rollout_ref.model.share_prompts=maybe"])


def test_relative_paths_are_the_drivers_and_hub_names_stay(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    (tmp_path / "train.parquet").touch()
    cfg = load_config(
        "grpo",
        [
            "trainer.output_dir=runs/a",
            "actor_rollout_ref.model.path=model",
            "critic.model.path=Qwen/Qwen2.5-0.5B",  # no such directory here: a hub name
            "data.train_files=[train.parquet,hdfs://data/x.parquet]",
        ],
        validate=False,
    )
    assert cfg.trainer.output_dir == str(tmp_path / "runs" / "a")
    assert cfg.actor_rollout_ref.model.path == str(tmp_path / "model")
    assert cfg.critic.model.path == "Qwen/Qwen2.5-0.5B"
    assert cfg.data.train_files == [str(tmp_path / "train.parquet"), "hdfs://data/x.parquet"]
