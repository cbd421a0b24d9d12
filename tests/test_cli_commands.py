"""Every command of the README, run as a user runs it: `python -m rayrl.cli.main ...` in
a process of its own, on small things (a tiny model, a few GSM8K-shaped rows, one or
two steps), so a crash in any command fails the suite. The commands that need a
cluster join the session's local Ray (`--address` / `resources.address`) instead of
starting one each. `rayrl demo` runs in tests/test_demo_pipeline.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import start_local_ray

pytestmark = pytest.mark.command  # the README's commands, run as a user runs them

GSM8K_ROWS = [
    {
        "question": f"Tom has {a} apples and buys {b} more. How many now?",
        "answer": f"{a}+{b}\n#### {a + b}",
    }
    for a, b in ((1, 2), (3, 4), (5, 6), (7, 8), (2, 2), (4, 1), (6, 3), (9, 9))
]


def rayrl(*args: str, cwd: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """`rayrl ARGS` in a fresh process (the env's PYTHONPATH: this checkout's src)."""
    done = subprocess.run(
        [sys.executable, "-m", "rayrl.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=os.environ,
        cwd=cwd,
    )
    assert "Traceback" not in done.stderr, done.stderr[-4000:]
    return done


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """`rayrl models tiny`: the model every other command here uses."""
    out = tmp_path_factory.mktemp("model") / "tiny"
    return out, rayrl("models", "tiny", "--out", str(out), "--layers", "2")


@pytest.fixture(scope="module")
def gsm8k_parquet(tmp_path_factory):
    """`rayrl data gsm8k` on eight GSM8K-shaped rows: the training data here."""
    root = tmp_path_factory.mktemp("data")
    jsonl = root / "gsm8k.jsonl"
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in GSM8K_ROWS))
    out = root / "train.parquet"
    return out, rayrl("data", "gsm8k", str(jsonl), str(out))


def _grpo_train(tiny_model, gsm8k_parquet) -> list[str]:
    """`rayrl train` of GRPO on the tiny model and the GSM8K rows, small batches."""
    return [
        "train",
        "-c",
        "grpo",
        f"actor_rollout_ref.model.path={tiny_model[0]}",
        f"data.train_files={gsm8k_parquet[0]}",
        "data.max_prompt_length=128",
        "data.max_response_length=8",
        "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    ]


@pytest.fixture(scope="module")
def gcs():
    """The session's local Ray, which the commands below join."""
    return start_local_ray().get_runtime_context().gcs_address


@pytest.fixture(scope="module")
def rl_run(tmp_path_factory, tiny_model, gsm8k_parquet, gcs):
    """`rayrl train`: one GRPO step on the GSM8K rows, with a checkpoint."""
    run = tmp_path_factory.mktemp("rl") / "run"
    done = rayrl(
        *_grpo_train(tiny_model, gsm8k_parquet),
        "trainer.total_training_steps=1",
        "actor_rollout_ref.model.share_prompts=true",  # off by default on a CPU
        "trainer.save_freq=1",
        "trainer.val_before_train=false",
        "trainer.device=cpu",
        "trainer.logger=[console]",
        f"trainer.output_dir={run}",
        f"resources.address={gcs}",
    )
    return run, done


def test_models_tiny_builds_a_model_directory(tiny_model):
    out, done = tiny_model
    assert done.returncode == 0, done.stderr
    assert (out / "config.json").is_file() and "parameters:" in done.stdout


def test_data_gsm8k_and_convert_write_verl_parquet(gsm8k_parquet, tmp_path):
    import pyarrow.parquet as pq

    path, done = gsm8k_parquet
    assert done.returncode == 0 and "8 rows ->" in done.stdout, done.stderr
    table = pq.read_table(path).to_pylist()
    assert table[0]["reward_model"]["ground_truth"] == "3"
    qa = tmp_path / "qa.jsonl"
    qa.write_text(json.dumps({"q": "2+2?", "a": "4"}) + "\n")
    done = rayrl(
        "data",
        "convert",
        str(qa),
        str(tmp_path / "qa.parquet"),
        "--prompt-key",
        "q",
        "--answer-key",
        "a",
        "--data-source",
        "arithmetic",
    )
    assert done.returncode == 0, done.stderr
    assert pq.read_table(tmp_path / "qa.parquet").to_pylist()[0]["data_source"] == "arithmetic"


def test_config_show_prints_the_resolved_config():
    done = rayrl(
        "config", "show", "-c", "ppo", "critic.optim.lr=2e-5", "trainer.default_local_dir=/x"
    )
    assert done.returncode == 0, done.stderr
    assert "lr: 2.0e-05" in done.stdout and "output_dir: /x" in done.stdout


def test_plan_and_doctor_report_on_the_cluster(gcs):
    done = rayrl("plan", "--address", gcs, "-c", "grpo", "trainer.device=cpu")
    assert done.returncode in (0, 1), done.stderr  # fits now, or waits for others' holds
    assert "cluster" in done.stdout and "node" in done.stdout
    done = rayrl("doctor", "--address", gcs, "--timeout", "60")
    assert done.returncode in (0, 1), done.stderr  # 1: stale groups of other tests
    assert "live node(s)" in done.stdout


@pytest.mark.slow
@pytest.mark.timeout(900)  # a run in a process of its own, on a loaded 2-core machine
def test_train_runs_a_step_and_keeps_a_checkpoint(rl_run):
    run, done = rl_run
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ready in" in done.stdout and "stopped in" in done.stdout
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 1 and "actor/pg_loss" in rows[-1]
    assert (run / "checkpoints" / "global_step_1").is_dir()


@pytest.mark.slow
@pytest.mark.timeout(900)  # a run in a process of its own, on a loaded 2-core machine
def test_report_and_export_read_the_run(rl_run, tmp_path):
    run, done = rl_run
    assert done.returncode == 0, done.stderr[-3000:]
    report = rayrl("report", str(run))
    assert report.returncode == 0, report.stderr
    assert Path(report.stdout.strip()).is_file()
    export = rayrl("export", str(run / "checkpoints" / "global_step_1"), str(tmp_path / "hf"))
    assert export.returncode == 0, export.stderr
    assert (tmp_path / "hf" / "config.json").is_file()


@pytest.mark.slow
@pytest.mark.timeout(900)  # a run in a process of its own, on a loaded 2-core machine
def test_sft_trains_with_verls_sft_keys(tmp_path, tiny_model, gsm8k_parquet):
    """The keys of verl's examples/sft/gsm8k scripts (prompt and response inside
    extra_info), two steps, in a Ray it starts itself as a user's does (the demo's SFT
    crashed there once: its config was read for the RL data loader's key)."""
    done = rayrl(
        "sft",
        f"data.train_files={gsm8k_parquet[0]}",
        "data.prompt_key=extra_info",
        "data.response_key=extra_info",
        "data.prompt_dict_keys=['question']",
        "+data.response_dict_keys=['answer']",
        "data.train_batch_size=4",
        "data.micro_batch_size_per_gpu=2",
        "data.max_length=128",
        f"model.partial_pretrain={tiny_model[0]}",
        "model.enable_gradient_checkpointing=false",
        "trainer.total_training_steps=2",
        "trainer.n_gpus_per_node=1",
        "trainer.device=cpu",
        "trainer.logger=console",
        f"trainer.default_local_dir={tmp_path / 'sft'}",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 2 and (tmp_path / "sft" / "hf" / "config.json").is_file()


@pytest.mark.slow
def test_async_train_on_one_core_starts_a_ray_that_holds_its_three_pools(
    tmp_path, tiny_model, gsm8k_parquet
):
    """Async training needs a trainer, a reward worker and a rollout replica: on a
    machine of fewer cores the local Ray gets a logical CPU for each (issue of a 2-core
    laptop: the pools did not fit)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(
        [
            "taskset",
            "-c",
            str(min(os.sched_getaffinity(0))),  # this process's first core: one core
            sys.executable,
            "-m",
            "rayrl.cli.main",
            *_grpo_train(tiny_model, gsm8k_parquet),
            "actor_rollout_ref.rollout.mode=async",
            "rollout.n_gpus_per_node=1",
            "trainer.total_training_steps=2",
            "trainer.val_before_train=false",
            "trainer.device=cpu",
            "trainer.logger=[jsonl]",
            f"trainer.output_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "the local Ray starts with 3 logical CPUs" in done.stdout
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "async/staleness/mean" in row] == [1, 2]
    workers = json.loads((tmp_path / "workers.json").read_text())["workers"]
    assert {w["group"] for w in workers} == {"actor_rollout_ref", "rollout"}  # the replica too


@pytest.mark.skipif(importlib.util.find_spec("swanlab") is not None, reason="swanlab installed")
def test_a_tracker_without_its_package_stops_train_with_the_extra_to_install(tmp_path):
    done = rayrl(
        "train",
        "-c",
        "grpo",
        "trainer.logger=[console,swanlab]",
        "trainer.device=cpu",
        f"trainer.output_dir={tmp_path}",
    )
    assert done.returncode == 2
    assert "pip install 'rayrl[swanlab]'" in done.stderr


def test_mistakes_in_the_users_paths_stop_train_before_ray_starts(
    tmp_path, tiny_model, gsm8k_parquet
):
    """A reward file that is missing, broken or lacks its function, a tool the tool
    config names that cannot be imported, a misspelt built-in tool, a model path that is no directory: one
    `config error:` or `model error:` line naming the key and what to fix, exit code 2,
    no traceback, before any Ray or worker starts."""
    misspelt = tmp_path / "reward.py"
    misspelt.write_text(
        "def compute_scor(data_source, solution_str, ground_truth):\n    return 0\n"
    )
    broken = tmp_path / "broken.py"
    broken.write_text("def compute_score(:\n")
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class_name: my_pkg.missing.Tool\n    config: {}\n")
    cases = {
        "custom_reward_function.path=/nonexistent/reward.py": "no such file /nonexistent/reward.py",
        f"custom_reward_function.path={misspelt}": "Did you mean 'compute_scor'?",
        f"custom_reward_function.path={broken}": "line 1 is not valid Python",
        "actor_rollout_ref.rollout.multi_turn.enable=true "
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}": (
            f"the tools of tool_config_path='{tools}'"
        ),
        "actor_rollout_ref.rollout.multi_turn.enable=true "
        "actor_rollout_ref.rollout.multi_turn.tools=[calculater]": (
            "unknown tool 'calculater'. Did you mean 'calculator'?"
        ),
        "actor_rollout_ref.model.path=/nonexistent/model": "model error: actor_rollout_ref."
        "model.path=/nonexistent/model: no such directory",
        f"actor_rollout_ref.model.path={tiny_model[0] / 'config.json'}": "is a file, not a model",
        "actor_rollout_ref.model.path=~/model": "'~' is not expanded",
        "reward_model.enable=true reward_model.model.path=/nonexistent/rm": (
            "reward_model.model.path=/nonexistent/rm: no such directory"
        ),
    }
    runs = [  # each a `rayrl train` of its own, all at once (each only loads and checks)
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rayrl.cli.main",
                *_grpo_train(tiny_model, gsm8k_parquet),
                "trainer.device=cpu",
                f"trainer.output_dir={tmp_path / f'run{i}'}",
                *overrides.split(),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=os.environ,
        )
        for i, overrides in enumerate(cases)
    ]
    for run, says in zip(runs, cases.values(), strict=True):
        stdout, stderr = run.communicate(timeout=300)
        done = subprocess.CompletedProcess(run.args, run.returncode, stdout, stderr)
        assert "Traceback" not in done.stderr, done.stderr[-4000:]
        assert done.returncode == 2, done.stderr[-2000:]
        assert done.stderr.startswith(("config error: ", "model error: ")), done.stderr
        assert says in done.stderr, done.stderr
        assert "Ray" not in done.stdout + done.stderr, done.stdout  # nothing was started


def test_train_reads_json_lines_through_the_ray_data_loader_on_a_small_machine(
    tmp_path, tiny_model, gsm8k_parquet
):
    """verl's JSON Lines data files, read by `data.loader=ray` in the Ray that `rayrl
    train` starts itself: Ray Data gets a CPU beside the pools (on this 2-core machine
    the pools take both cores, and its ordering tasks waited forever)."""
    import pyarrow.parquet as pq

    rows = pq.read_table(gsm8k_parquet[0]).to_pylist()
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "run"
    done = rayrl(
        *_grpo_train(tiny_model, gsm8k_parquet),
        f"data.train_files={jsonl}",
        "data.loader=ray",
        "trainer.total_training_steps=2",
        "trainer.device=cpu",
        "trainer.logger=[jsonl]",
        f"trainer.output_dir={out}",
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
