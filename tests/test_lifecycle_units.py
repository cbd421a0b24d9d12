"""The pieces around a run, without Ray: tracker checks, validation metrics, usage
warnings, the metrics file on resume, and `rayrl data`."""

from __future__ import annotations

import importlib.util
import json
import sys

import pyarrow.parquet as pq
import pytest

from rayrl.cli.main import main
from rayrl.config import load_config
from rayrl.trainer.metrics import usage_metrics
from rayrl.trainer.replay import _charge_to_step
from rayrl.trainer.run_dir import RunDir
from rayrl.trainer.tracking import TrackerUnavailable, Tracking, check_trackers
from rayrl.trainer.validate import pass_at_k, validation_metrics


def test_a_missing_tracker_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what an uninstalled package looks like
    with pytest.raises(TrackerUnavailable, match=r"pip install 'rayrl\[wandb\]'"):
        check_trackers(["console", "wandb"])
    installed = [t for t in ("tensorboard", "mlflow") if importlib.util.find_spec(t)]
    check_trackers(["console", "jsonl", *installed])


def test_the_trainer_checks_trackers_before_reserving_anything(monkeypatch, tmp_path):
    from rayrl.trainer.ppo import PPOTrainer
    from rayrl.trainer.run import Run

    monkeypatch.setitem(sys.modules, "mlflow", None)
    cfg = load_config("grpo", [f"trainer.output_dir={tmp_path}", "trainer.logger=[mlflow]"])
    run = Run(PPOTrainer(cfg))
    with pytest.raises(TrackerUnavailable, match=r"rayrl\[mlflow\]"):
        run.setup()
    assert run.pools == [] and run.session is None


def test_tensorboard_writes_to_tensorboard_dir_else_verls_variable_else_the_run(
    tmp_path, monkeypatch
):
    """`trainer.tensorboard_dir` (a verl recipe's key), else verl's $TENSORBOARD_DIR,
    else OUTPUT_DIR/tensorboard."""
    cfg = load_config("grpo", [f"trainer.tensorboard_dir={tmp_path / 'tb'}"])
    (tmp_path / "run").mkdir()
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "env"))
    for configured, where in (
        (cfg.trainer.tensorboard_dir, tmp_path / "tb"),
        (None, tmp_path / "env"),
    ):
        tracking = Tracking(
            ["tensorboard"],
            tmp_path / "run",
            project="p",
            experiment="e",
            config={},
            tensorboard_dir=configured,
        )
        tracking.log({"actor/pg_loss": 0.5}, step=1)
        tracking.finish()
        assert any(p.name.startswith("events.out.tfevents") for p in where.iterdir()), where
    monkeypatch.delenv("TENSORBOARD_DIR")
    Tracking(["tensorboard"], tmp_path / "run", project="p", experiment="e", config={}).finish()
    assert (tmp_path / "run" / "tensorboard").is_dir()


def test_jsonl_is_always_written_and_console_prints(tmp_path):
    lines: list[str] = []
    tracking = Tracking(
        ["console"], tmp_path, project="p", experiment="e", config={}, print_fn=lines.append
    )
    tracking.log(
        {"critic/score/mean": 0.5, "val-core/x/reward/mean@1": 1.0, "nan": float("nan")}, step=3
    )
    tracking.finish()
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row == {
        "step": 3,
        "critic/score/mean": 0.5,
        "val-core/x/reward/mean@1": 1.0,
        "nan": None,
    }
    assert lines == ["step 3: score=0.5 val-core/x/reward/mean@1=1"]


def test_validation_metrics_mean_and_pass_at_k():
    samples = [
        {"data_source": "a", "uid": "p0", "score": 1.0, "extra": {"acc": 1.0}},
        {"data_source": "a", "uid": "p0", "score": 0.1, "extra": {"acc": 0.0}},
        {"data_source": "a", "uid": "p1", "score": 0.1, "extra": {"acc": 0.0}},
        {"data_source": "a", "uid": "p1", "score": 0.0, "extra": {"acc": 0.0}},
        {"data_source": "b", "uid": "q0", "score": 1.0, "extra": {}},
        {"data_source": "b", "uid": "q0", "score": 1.0, "extra": {}},
    ]
    m = validation_metrics(samples, n=2)
    assert m["val-core/a/reward/mean@2"] == pytest.approx((0.55 + 0.05) / 2)
    assert m["val-core/a/acc/mean@2"] == pytest.approx(0.25)
    assert m["val-core/a/reward/pass@2"] == pytest.approx(0.5)  # acc decides, not score > 0
    assert m["val-aux/a/reward/pass@1"] == pytest.approx(0.25)
    assert m["val-aux/a/reward/best@2"] == pytest.approx(0.55)
    assert m["val-core/b/reward/mean@2"] == 1.0 and m["val-core/b/reward/pass@2"] == 1.0
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    greedy = validation_metrics(samples[:1], n=1)
    assert set(greedy) == {"val-core/a/reward/mean@1", "val-core/a/acc/mean@1"}


def test_usage_metrics_and_cpu_starvation_warning():
    from rayrl.controller.usage import starved_stages

    stage = {"samples": 4, "cpu_util": 97.0, "cpu_util_max": 100.0, "rss_gb_max": 1.5}
    starving = {
        "stages": {"actor/generate": {**stage, "gpu_util": 35.0}},
        "num_cpus": 1.0,
        "max_memory_allocated_gb": 20.0,
    }
    busy_gpu = {"stages": {"actor/generate": {**stage, "gpu_util": 95.0}}, "num_cpus": 1.0}
    cpu_only = {"stages": {"reward/compute_score": {**stage, "gpu_util": None}}, "num_cpus": 1.0}
    warnings = starved_stages({"actor_rollout_ref": [starving, busy_gpu], "reward": [cpu_only]})
    assert len(warnings) == 1
    assert "actor rank 0 is CPU-starved in generate" in warnings[0]
    assert "num_cpus=1" in warnings[0] and "resources.cpus_per_worker" in warnings[0]
    metrics = usage_metrics({"actor_rollout_ref": [starving, busy_gpu], "reward": [cpu_only]})
    assert metrics["perf/cpu_util/actor"] == 97.0
    assert metrics["perf/gpu_util/actor"] == 65.0
    assert metrics["perf/stage_gpu_util/actor/generate"] == 65.0
    assert metrics["perf/max_memory_allocated_gb/actor"] == 20.0  # CUDA peak when known
    assert metrics["perf/max_memory_allocated_gb/reward"] == 1.5  # else resident memory
    assert "perf/gpu_util/reward" not in metrics


def test_checkpointed_driver_parts_restore_the_adaptive_kl_controller(tmp_path):
    from rayrl.trainer.checkpoint import CheckpointManager, load_states
    from rayrl.trainer.ppo import PPOTrainer
    from rayrl.trainer.run import Run
    from rayrl.trainer.state import Progress, capture, restore

    overrides = [
        f"trainer.output_dir={tmp_path}",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.type=adaptive",
        "algorithm.kl_ctrl.kl_coef=0.05",
    ]
    first = Run(PPOTrainer(load_config("grpo", overrides)))
    first.trainer.advantage.kl_ctrl.update(0.5, n_steps=64)  # KL above target: it grows
    first.progress.load_state_dict(Progress(7, 1, 3, 24).state_dict())
    path = CheckpointManager(tmp_path / "ckpt").save(7, capture(first.parts()), lambda tmp: None)
    second = Run(PPOTrainer(load_config("grpo", overrides)))
    assert second.trainer.advantage.kl_ctrl.value == 0.05
    restore(second.parts(), load_states(path))  # the driver's part of `Run.restore`
    assert second.trainer.advantage.kl_ctrl.value == first.trainer.advantage.kl_ctrl.value
    assert second.trainer.advantage.kl_ctrl.value > 0.05
    assert second.progress == Progress(7, 1, 3, 24)


def test_resumed_metrics_file_keeps_rows_up_to_the_checkpoint(tmp_path):
    run = RunDir(tmp_path)
    run.metrics.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(6)))
    run.keep_metrics_until(3)
    assert [json.loads(x)["step"] for x in run.metrics.read_text().splitlines()] == [0, 1, 2, 3]


def test_data_convert_maps_columns_to_verl_layout(tmp_path, capsys):
    src = tmp_path / "qa.jsonl"
    src.write_text(
        json.dumps({"question": "What is 2+2?", "solution": 4, "topic": "sums"})
        + "\n"
        + json.dumps({"question": "What is 3*3?", "solution": 9, "topic": "products"})
        + "\n"
    )
    out = tmp_path / "qa.parquet"
    code = main(
        [
            "data",
            "convert",
            str(src),
            str(out),
            "--prompt-key",
            "question",
            "--answer-key",
            "solution",
            "--data-source",
            "arithmetic",
        ]
    )
    assert code == 0
    rows = pq.read_table(out).to_pylist()
    assert rows[1]["data_source"] == "arithmetic"
    assert rows[1]["prompt"] == [{"role": "user", "content": "What is 3*3?"}]
    assert rows[1]["reward_model"] == {"style": "rule", "ground_truth": "9"}
    assert rows[1]["extra_info"]["topic"] == "products" and rows[1]["extra_info"]["index"] == 1
    assert main(["data", "convert", str(src), str(out)]) == 2
    assert "no column 'prompt'" in capsys.readouterr().err


def test_data_gsm8k_writes_verl_columns_and_the_instruction(tmp_path):
    from rayrl.data import PromptDataset
    from rayrl.models.tokenizer import train_tokenizer
    from rayrl.rewards.registry import compute_score

    src = tmp_path / "gsm8k.jsonl"
    src.write_text(
        json.dumps(
            {
                "question": "Tom has 3 apples and buys 1,000 more. How many?",
                "answer": "3 + 1000 = 1003\n#### 1,003",
            }
        )
        + "\n"
    )
    out = tmp_path / "train.parquet"
    assert main(["data", "gsm8k", str(src), str(out)]) == 0
    (row,) = pq.read_table(out).to_pylist()
    assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
    assert row["prompt"][0]["content"].endswith(
        'How many? Let\'s think step by step and output the final answer after "####".'
    )
    assert row["reward_model"]["ground_truth"] == "1003"
    assert row["extra_info"]["split"] == "train"
    assert (
        compute_score(row["data_source"], "so #### 1003", row["reward_model"]["ground_truth"])[
            "score"
        ]
        == 1.0
    )
    assert len(PromptDataset([row], train_tokenizer(), max_prompt_length=256)) == 1


def test_dashboard_port_moves_past_a_taken_one():
    import socket

    from rayrl.trainer.ray_session import free_port

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        assert free_port("127.0.0.1", taken) != taken
    assert free_port("127.0.0.1", taken) == taken  # released: the configured port again


DASHBOARD_START = """
import socket, sys, time
from rayrl.trainer.ray_session import reserve_dashboard_port
with reserve_dashboard_port("127.0.0.1", int(sys.argv[1]), listen_timeout_s=10) as port:
    time.sleep(0.5)  # both have looked by now, were the choice not serialised
    server = socket.socket()
    server.bind(("127.0.0.1", port))  # what the dashboard does, after ray.init returns
    server.listen()
print(port, flush=True)
time.sleep(3)  # keep listening while the other one chooses
"""


def test_two_runs_started_together_get_different_dashboard_ports():
    """Two local Rays started at once both found 8265 free, and the second died when its
    dashboard could not bind it: choosing the port is serialised until the first listens."""
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        wanted = probe.getsockname()[1]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", DASHBOARD_START, str(wanted)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    ports = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-2000:]
        ports.append(int(out.split()[0]))
    assert wanted in ports and len(set(ports)) == 2, ports


def test_minimal_ray_runs_without_the_dashboard(monkeypatch):
    """A Ray without its dashboard packages (ray minimal, as on the GPU machine) starts
    without the dashboard and says so, instead of failing in ray.init."""
    from rayrl.cluster import ray_private
    from rayrl.trainer.ray_session import _dashboard_installed

    if ray_private.dashboard_dependency_error() is None:  # ray[default] here (CI)
        assert _dashboard_installed()
    monkeypatch.setattr(ray_private, "dashboard_dependency_error", lambda: "No module named 'x'")
    with pytest.warns(UserWarning, match="running without it"):
        assert not _dashboard_installed()


def test_the_step_snapshot_is_charged_to_the_step_and_its_throughput():
    metrics = {"timing_s/step": 1.0, "perf/throughput": 100.0}
    _charge_to_step(metrics, 0.25)
    assert metrics == {"timing_s/step": 1.25, "perf/throughput": 80.0, "timing_s/snapshot": 0.25}


def test_worker_prefixes_lose_their_colours_only_when_output_is_redirected(monkeypatch):
    import logging
    import os

    from rayrl.trainer.ray_session import RAY_COLOURED_LOGGERS, plain_worker_prefixes

    class Stream:
        def __init__(self, tty: bool) -> None:
            self.tty = tty

        def isatty(self) -> bool:
            return self.tty

    loggers = [logging.getLogger(name) for name in ("ray", *RAY_COLOURED_LOGGERS)]
    for logger in loggers:  # the filters are the process's: put back as they were
        monkeypatch.setattr(logger, "filters", list(logger.filters))
    monkeypatch.delenv("RAY_COLOR_PREFIX", raising=False)
    assert not plain_worker_prefixes((Stream(True), Stream(True)))  # a terminal: colours
    assert "RAY_COLOR_PREFIX" not in os.environ
    assert plain_worker_prefixes((Stream(True), Stream(False)))  # stderr to a file
    assert os.environ["RAY_COLOR_PREFIX"] == "0"
    monkeypatch.setenv("RAY_COLOR_PREFIX", "1")  # the user's choice is kept
    assert not plain_worker_prefixes((Stream(False), Stream(False)))
    assert os.environ["RAY_COLOR_PREFIX"] == "1"
    # Ray's own coloured line (ray.init's dashboard URL) comes out plain
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    worker_log = logging.getLogger(RAY_COLOURED_LOGGERS[0])
    worker_log.addHandler(handler)
    try:
        worker_log.warning(
            "View the dashboard at %s%s%s", "\x1b[1m\x1b[32m", "http://h:1", "\x1b[39m"
        )
    finally:
        worker_log.removeHandler(handler)
    assert seen == ["View the dashboard at http://h:1"]
