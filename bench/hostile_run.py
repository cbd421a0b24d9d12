"""What every hostile case shares: `rayrl train` in its own process with small base
settings, its output and metrics, a bounded wait, and the verdict."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
BASE = [
    "-c",
    "grpo",
    "trainer.device=cpu",
    "trainer.logger=[jsonl]",
    "trainer.val_before_train=false",
    "trainer.export_hf=false",
    "trainer.total_training_steps=2",
    "data.train_batch_size=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.rollout.n=2",
    "data.max_response_length=8",
    "resources.dashboard=false",
]


def train(out: Path, *extra: str, wait: bool = True, timeout: float = 600):
    """`rayrl train` with the small base settings in `out`; the finished process (or the
    running one with `wait=False`)."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "rayrl.cli.main", "train", *BASE]
    cmd += [f"trainer.output_dir={out}", *extra]
    if not wait:
        return subprocess.Popen(
            cmd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
    return subprocess.run(cmd, env=env, text=True, capture_output=True, timeout=timeout)


def text(done) -> str:
    return (done.stdout or "") + (done.stderr or "")


def rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def until(predicate: Callable[[], bool], timeout: float = 300) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.3)
    return False


def verdict(handled: bool, detail: str) -> dict:
    return {"handled": bool(handled), "detail": detail}
