"""What a resume checks before it trains, and the run directory's guards: one run per
directory (a lock held by a real second process), a read-only or full disk named with
its path, a damaged checkpoint named and the last intact step taken, a changed run
refused with what changed, the data position kept across a batch-size change, and
the batches a resumed run sees."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rayrl.config import load_config
from rayrl.trainer.checkpoint import CheckpointManager, CheckpointWriteError
from rayrl.trainer.manifest import CheckpointDamagedError, check_files, model_identity
from rayrl.trainer.ppo import PPOTrainer
from rayrl.trainer.resume import ResumeError, check_fingerprint, intact_checkpoint, reposition
from rayrl.trainer.run import Run, RunDirError
from rayrl.trainer.run_lock import RunDirLockedError, RunLock
from rayrl.trainer.state import Progress

HOLD = """
import sys, time
from pathlib import Path
from rayrl.trainer.run_lock import RunLock
RunLock(Path(sys.argv[1])).acquire("holder-run")
print("HELD", flush=True)
time.sleep(60)
"""


def test_a_second_run_on_a_locked_directory_is_refused_naming_the_holder(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "HELD"
        with pytest.raises(RunDirLockedError) as info:
            RunLock(tmp_path).acquire("second")
        text = str(info.value)
        assert f"pid {holder.pid}" in text and "holder-run" in text and "host" in text
    finally:
        holder.kill()
        holder.wait()
    lock = RunLock(tmp_path).acquire("third")  # a killed holder leaves no stale lock
    assert lock.held
    lock.release()


def _save(manager: CheckpointManager, step: int, fingerprint: dict | None = None) -> Path:
    def write(tmp: Path) -> None:
        (tmp / "actor").mkdir()
        torch.save({"w": torch.arange(step + 4096.0)}, tmp / "actor" / "model.pt")

    states = {"progress": Progress(step, 0, step, step * 4).state_dict()}
    return manager.save(step, states, write, fingerprint=fingerprint or {"model": "m"})


def test_a_damaged_checkpoint_is_named_and_auto_resume_takes_the_last_intact_one(tmp_path):
    manager = CheckpointManager(tmp_path)
    first, second = _save(manager, 1), _save(manager, 2)
    check_files(second)
    shard = second / "actor" / "model.pt"
    shard.write_bytes(shard.read_bytes()[:100])  # truncated, as a crash mid-copy leaves it
    with pytest.raises(CheckpointDamagedError, match=r"actor/model.pt: 100 bytes where the save"):
        check_files(second)
    said: list[str] = []
    assert intact_checkpoint(manager, second, "auto", said.append) == first
    assert "damaged" in said[0] and str(first) in said[0]
    with pytest.raises(ResumeError, match=rf"the last intact one is {first}"):
        intact_checkpoint(manager, second, "resume_path", said.append)
    (first / "trainer_state.pt").write_bytes(b"garbage")  # same file, other contents
    with pytest.raises(ResumeError, match="no earlier intact step"):
        intact_checkpoint(manager, second, "auto", said.append)


def test_a_changed_run_is_refused_listing_what_changed(tmp_path):
    saved = {"model": {"path": "/m/a"}, "data.train_batch_size": 8, "critic": False}
    path = _save(CheckpointManager(tmp_path), 3, fingerprint=saved)
    now = {**saved, "model": {"path": "/m/b"}, "data.train_batch_size": 16}
    with pytest.raises(ResumeError) as info:
        check_fingerprint(path, now, "strict", print)
    text = str(info.value)
    assert "data.train_batch_size: 8 -> 16" in text and "/m/a" in text and "/m/b" in text
    assert "trainer.resume_check=warn" in text and "critic" not in text
    said: list[str] = []
    check_fingerprint(path, now, "warn", said.append)
    assert "although the run changed" in said[0]
    check_fingerprint(path, saved, "strict", said.append)  # the same run: nothing said
    assert len(said) == 1


def test_the_same_model_files_elsewhere_resume_and_other_files_in_place_do_not(tmp_path):
    files = {"model.safetensors": {"size": 10, "crc32": 1}}
    saved = {"model": {"path": "/runs/a/model", "files": files}}
    path = _save(CheckpointManager(tmp_path), 3, fingerprint=saved)
    moved = {"model": {"path": "/runs/b/model", "files": files}}
    check_fingerprint(path, moved, "strict", print)  # copied or moved: the same model
    other = {
        "model": {"path": "/runs/a/model", "files": {"model.safetensors": {"size": 10, "crc32": 2}}}
    }
    with pytest.raises(ResumeError, match="crc32"):
        check_fingerprint(path, other, "strict", print)


def test_the_data_position_survives_a_batch_size_change():
    said: list[str] = []
    progress = Progress(global_step=10, epoch=1, batch=10, sample=80)  # batches of 8
    reposition(progress, 16, said.append)
    assert progress.batch == 5 and progress.sample == 80 and "row 80" in said[0]
    same = Progress(10, 1, 10, 80)
    reposition(same, 8, said.append)
    assert same.batch == 10 and len(said) == 1
    with pytest.raises(ResumeError, match="not at the start of a batch"):
        reposition(Progress(10, 1, 10, 80), 24, said.append)
    legacy = Progress(10, 1, 10, -1)  # no row position kept: the batch index stands
    reposition(legacy, 16, said.append)
    assert legacy.batch == 10


def _run(tmp_path: Path, *extra: str) -> Run:
    cfg = load_config(
        "grpo",
        [
            "data.train_batch_size=4",
            "data.synthetic_size=16",
            "trainer.total_epochs=2",
            "trainer.total_training_steps=null",
            f"trainer.output_dir={tmp_path}",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            *extra,
        ],
    )
    run = Run(PPOTrainer(cfg))
    run.data = run.trainer.load_data()
    return run


def test_a_resumed_run_sees_the_batches_the_uninterrupted_run_saw_from_there(tmp_path):
    clean = [(step, list(b["uid"]), b.meta["epoch"]) for step, b in _run(tmp_path).batches()]
    assert len(clean) == 8  # 4 batches of 4 per epoch, 2 epochs
    resumed = _run(tmp_path)
    for position in (Progress(3, 0, 3, 12), Progress(4, 1, 0, 0), Progress(6, 1, 2, 8)):
        resumed.progress.load_state_dict(position.state_dict())
        seen = [(s, list(b["uid"]), b.meta["epoch"]) for s, b in resumed.batches()]
        assert seen == clean[position.global_step :], position
    reseeded = _run(tmp_path, "trainer.seed=2")
    assert [list(b["uid"]) for _, b in reseeded.batches()] != [uids for _, uids, _ in clean]


def _mount_tmpfs(path: Path, options: str) -> bool:
    if os.geteuid() != 0:
        return False
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)])
    return done.returncode == 0


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_read_only_run_directory_is_named_before_anything_starts(tmp_path):
    root = tmp_path / "ro"
    if not _mount_tmpfs(root, "ro,size=1m"):
        pytest.skip("needs root to mount a read-only tmpfs")
    try:
        run = _run(tmp_path / "data-dir")
        run.run_dir = type(run.run_dir)(root / "out")
        run.lock = RunLock(root / "out")
        with pytest.raises(RunDirError, match=r"cannot write the run directory .*Read-only"):
            run.setup()
        assert run.session is None and run.pools == []
    finally:
        _umount(root)


def test_a_full_disk_during_a_checkpoint_is_named_and_the_last_one_stays(tmp_path):
    root = tmp_path / "small"
    if not _mount_tmpfs(root, "size=2m"):
        pytest.skip("needs root to mount a small tmpfs")
    try:
        manager = CheckpointManager(root / "checkpoints")
        first = _save(manager, 1)

        def big(tmp: Path) -> None:
            (tmp / "actor").mkdir()
            torch.save({"w": torch.zeros(1 << 20)}, tmp / "actor" / "model.pt")  # 4 MiB

        with pytest.raises(CheckpointWriteError, match=r"is full.*ran out of space after"):
            manager.save(2, {}, big)
        assert manager.latest() == first and not list(manager.root.glob(".tmp-*"))
        free = shutil.disk_usage(root).free  # leave less than the last checkpoint's size
        (root / "filler").write_bytes(b"x" * max(0, free - 4096))
        with pytest.raises(CheckpointWriteError, match=r"not enough space .* bytes needed"):
            _save(manager, 3)
    finally:
        _umount(root)
        time.sleep(0.1)


def test_weights_swapped_under_the_same_config_and_size_are_refused(tmp_path):
    """Every byte of the model's weights is in the run's fingerprint: another checkpoint
    of the same architecture put in the model directory (the same config.json, a
    model.safetensors of the same size, one byte different in the middle, far from the
    ends a cheap checksum reads) is refused, naming the file; a copy resumes."""
    run = _run(tmp_path)
    model = Path(run.trainer.model_path)
    weights = model / "model.safetensors"
    save_file({"w": torch.arange(1 << 20, dtype=torch.float32)}, str(weights))  # 4 MiB
    path = _save(CheckpointManager(tmp_path / "saved"), 3, fingerprint=run.fingerprint())
    check_fingerprint(path, run.fingerprint(), "strict", print)  # unchanged: resumes
    copy = shutil.copytree(model, tmp_path / "copy")
    check_fingerprint(path, {**run.fingerprint(), "model": model_identity(copy)}, "strict", print)
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(ResumeError) as info:
        check_fingerprint(path, run.fingerprint(), "strict", print)
    text = str(info.value)
    assert "model: model.safetensors: sha256" in text and "config.json" not in text
    assert "trainer.resume_check=warn" in text


def test_a_stop_inside_a_step_puts_the_drivers_parts_back_to_the_steps_start(tmp_path):
    """A Ctrl-C or SIGTERM inside a step abandons it: the workers' state goes back to the
    step's start, and so must the driver's (the adaptive KL controller the step's
    advantage stage already moved), or the checkpoint holds half a step."""
    from rayrl.trainer.interrupt import StopOnInterrupt
    from rayrl.trainer.state import capture

    run = _run(
        tmp_path,
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.type=adaptive",
        "algorithm.kl_ctrl.kl_coef=0.05",
    )
    kl = run.trainer.advantage.kl_ctrl
    run.replay = type("NoSnapshots", (), {"can_undo": False})()
    run._step_states = capture(run.parts())  # what Run._step keeps as a step starts
    kl.update(0.5, n_steps=64)  # the step's advantage stage moved it
    assert kl.value != 0.05
    saved: list[dict] = []
    run.save_checkpoint = lambda: saved.append(capture(run.parts())) or tmp_path
    run._stop_safely(StopOnInterrupt())
    assert kl.value == 0.05 and saved[0]["advantage"] == {"kl_ctrl": {"value": 0.05}}
    assert run.stopped
