"""Checkpoint directories: atomic saves, `latest`, retention, resume choices, and a save
killed half-way (a real process, SIGKILL) that leaves the previous checkpoint usable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import subprocess_pythonpath
from engine_cases import tiny_model_dir  # noqa: F401 (fixture)
from rayrl.trainer.checkpoint import CheckpointManager, load_states
from rayrl.trainer.state import Progress

TESTS = Path(__file__).resolve().parent


def _save(manager: CheckpointManager, step: int, payload: str = "x") -> Path:
    return manager.save(
        step,
        {"progress": Progress(global_step=step, epoch=1, batch=step).state_dict()},
        lambda tmp: (tmp / "actor").mkdir() or (tmp / "actor" / "w.txt").write_text(payload),
    )


def test_latest_retention_and_resume_choices(tmp_path):
    manager = CheckpointManager(tmp_path / "checkpoints", max_to_keep=2)
    assert manager.latest() is None and manager.resolve("auto") is None
    for step in (1, 2, 3):
        _save(manager, step)
    assert [p.name for p in manager.steps()] == ["global_step_2", "global_step_3"]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "global_step_3"
    assert manager.resolve("auto") == tmp_path / "checkpoints" / "global_step_3"
    assert manager.resolve("disable") is None
    chosen = manager.resolve("resume_path", tmp_path / "checkpoints" / "global_step_2")
    assert load_states(chosen)["progress"]["global_step"] == 2
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        manager.resolve("resume_path", tmp_path / "checkpoints" / "global_step_1")
    _save(manager, 3, payload="again")  # saving a step again replaces it
    assert (manager.latest() / "actor" / "w.txt").read_text() == "again"


def test_checkpoints_of_the_flat_state_layout_still_load(tmp_path):
    """trainer_state.pt written before the state came in parts: one flat dict."""
    step = tmp_path / "global_step_4"
    step.mkdir()
    torch.save(
        {"global_step": 4, "epoch": 1, "batch": 2, "kl_ctrl": {"kl_ctrl": 0.1}, "rng": {}},
        step / "trainer_state.pt",
    )
    states = load_states(step)
    assert states["progress"] == {"global_step": 4, "epoch": 1, "batch": 2}
    assert states["advantage"] == {"kl_ctrl": 0.1} and states["rng"] == {}
    progress = Progress()
    progress.load_state_dict(states["progress"])
    assert progress == Progress(4, 1, 2, -1)  # no row position was kept then


def test_a_stale_latest_marker_falls_back_to_the_newest_complete_step(tmp_path):
    manager = CheckpointManager(tmp_path)
    _save(manager, 1)
    assert manager.stale_marker() is None
    (tmp_path / "latest").write_text("global_step_9\n")  # points at nothing
    assert manager.latest() == tmp_path / "global_step_1"
    said = manager.stale_marker()  # the fallback is said, naming both steps
    assert said.startswith(f"{tmp_path / 'latest'} names 'global_step_9', which is missing")
    assert f"{tmp_path / 'global_step_1'}, is used instead" in said
    for path in (tmp_path / "global_step_1").rglob("*"):
        if path.is_file():
            path.unlink()  # no complete step left
    assert "no complete checkpoint is left" in manager.stale_marker()


KILLED_SAVE = """
import sys, time
from pathlib import Path
import torch
from rayrl.train.engine import TrainEngine
from rayrl.trainer.checkpoint import CheckpointManager

model, root, signal_file = sys.argv[1:4]
torch.manual_seed(0)
engine = TrainEngine(model, optim={"lr": 1e-3})
manager = CheckpointManager(root)
manager.save(1, {}, lambda tmp: engine.save(tmp / "actor"))
torch.save({k: v.clone() for k, v in engine.model.state_dict().items()}, Path(root) / "weights1.pt")
with torch.no_grad():
    for p in engine.model.parameters():
        p.add_(1.0)

def write_then_hang(tmp):
    engine.save(tmp / "actor")
    Path(signal_file).write_text(str(tmp))
    time.sleep(120)

manager.save(2, {}, write_then_hang)
"""


def test_a_save_killed_half_way_leaves_the_previous_checkpoint_loadable(tmp_path, tiny_model_dir):  # noqa: F811
    from rayrl.train.engine import TrainEngine

    root, signal_file = tmp_path / "checkpoints", tmp_path / "writing"
    env = {**os.environ, "PYTHONPATH": subprocess_pythonpath(TESTS.parent / "src", TESTS)}
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_SAVE, str(tiny_model_dir), str(root), str(signal_file)],
        env=env,
    )
    try:
        deadline = time.monotonic() + 120
        while not signal_file.exists():
            assert proc.poll() is None, "the saving process exited early"
            assert time.monotonic() < deadline, "the second save never started"
            time.sleep(0.1)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    partial = Path(signal_file.read_text())
    assert partial.is_dir() and partial.name.startswith(".tmp-global_step_2")
    manager = CheckpointManager(root)
    assert manager.latest() == root / "global_step_1"
    assert (root / "latest").read_text().strip() == "global_step_1"
    engine = TrainEngine(tiny_model_dir, optim={"lr": 1e-3})
    engine.load(manager.latest() / "actor")
    saved = torch.load(root / "weights1.pt")
    for name, value in engine.model.state_dict().items():
        assert torch.equal(value, saved[name]), name
    manager.save(2, {}, lambda tmp: engine.save(tmp / "actor"))
    assert not partial.exists()  # the next save clears what the killed one left
    assert manager.latest() == root / "global_step_2"
