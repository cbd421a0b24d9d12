"""`rayrl train` as a user runs it, in its own process with its own Ray: the dashboard
URL is printed, worker output reaches the terminal prefixed with role and rank (no
colour codes when the output is redirected), and
under `trainer.debug` the workers have Ray's debugger on (post-mortem included), and
its groups start side by side."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import subprocess_pythonpath

pytestmark = pytest.mark.slow
SRC = Path(__file__).resolve().parents[1] / "src"

REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    print("REWARD-FUNCTION-PRINT", flush=True)
    return {"score": 0.5, "acc": 0.0}
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dashboard_worker_prefixes_and_debugger(tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "rayrl.cli.main",
        "train",
        "-c",
        "grpo",
        "trainer.total_training_steps=1",
        "trainer.device=cpu",
        "data.train_batch_size=2",
        "data.max_response_length=4",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "trainer.val_before_train=false",
        "trainer.export_hf=false",
        "trainer.debug=true",
        f"resources.dashboard_port={port}",
        f"custom_reward_function.path={reward}",
        "reward.colocate=false",  # the reward in its own group: both groups' prefixes
        f"trainer.output_dir={tmp_path / 'run'}",
    ]
    env = {**os.environ, "PYTHONPATH": subprocess_pythonpath(SRC), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=280)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert f"Ray dashboard: http://127.0.0.1:{port}" in out
    assert re.search(r"\(reward rank 0 pid=\d+[^)]*\) REWARD-FUNCTION-PRINT", out), out[-3000:]
    assert "\x1b[" not in out, out[-3000:]  # redirected: no colour codes, Ray's prefixes too
    debugger = [line for line in out.splitlines() if line.startswith("Ray debugger in")]
    assert len(debugger) == 2, out[-3000:]  # the actor group and the reward group
    for line in debugger:
        assert "RAY_DEBUG=1" in line and "post-mortem on" in line
        assert "ray.util.rpdb.set_trace" in line
    # The two groups started side by side: the reward's init began before the actor's ended
    # (one after the other, it would begin only after); start-up and teardown are timed.
    workers = json.loads((tmp_path / "run" / "workers.json").read_text())["workers"]
    span = {w["group"]: w["init_span"] for w in workers}
    assert span["reward"][0] < span["actor_rollout_ref"][1], span
    assert re.search(r"ready in [\d.]+ s", out) and re.search(r"stopped in [\d.]+ s", out)
