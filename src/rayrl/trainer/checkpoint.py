"""Checkpoints of a run: atomic step directories, a `latest` marker, retention, resume.

    checkpoints/
      global_step_4/   actor/ (DCP shards, RNGs per rank, huggingface/, hf_meta.json)
                       critic/ (when there is a critic), trainer_state.pt
      global_step_6/
      latest           "global_step_6": written last, after the rename

`CheckpointManager.save` has the roles write into a temporary directory, writes the
driver's state (`trainer_state.pt`: each `Stateful` part's `state_dict()`, by name:
the run's progress and RNGs, the trainer's own parts such as the KL controller) last,
renames the directory into place and only then rewrites `latest`. A save that dies
half-way leaves a `.tmp-*` directory that no reader takes for a checkpoint (the next
save removes it); the previous checkpoint stays the latest. Only the newest
`max_to_keep` step directories are kept.

A checkpoint is a step boundary: restoring one (the roles' `load`, then the parts)
puts a run exactly where it was after that step, which is also what fault
tolerance needs to replay a step.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rayrl.trainer.manifest import write_manifest

STEP_DIR = re.compile(r"^global_step_(\d+)$")
LATEST = "latest"
STATE_FILE = "trainer_state.pt"


def step_of(path: Path) -> int | None:
    match = STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def is_complete(path: Path) -> bool:
    """A step directory that a finished save renamed into place (its state file is in)."""
    return step_of(path) is not None and (path / STATE_FILE).is_file()


def load_states(path: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """The driver parts' states of a checkpoint directory, by part name."""
    file = Path(path) / STATE_FILE
    if not file.is_file():
        raise FileNotFoundError(
            f"{path} is not a complete rayrl checkpoint (no {STATE_FILE}); pass a "
            "checkpoints/global_step_N directory of a finished save"
        )
    return _upgrade(torch.load(file, weights_only=False))


def _upgrade(states: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Checkpoints written before the state came in parts held one flat dict."""
    if "progress" in states:
        return states
    progress = {k: states[k] for k in ("global_step", "epoch", "batch")}
    upgraded = {"progress": progress, "rng": states.get("rng") or {}}
    if states.get("kl_ctrl") is not None:
        upgraded["advantage"] = states["kl_ctrl"]
    return upgraded


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (a full disk, a read-only filesystem)."""


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _out_of_space(err: BaseException) -> bool:
    """Whether `err` (or what it wraps, or its text: a worker's error arrives as text)
    says the disk is full."""
    cause: BaseException | None = err
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
            return True
        text = str(cause)
        if "No space left on device" in text or "unexpected pos" in text:
            return True  # torch's zip writer on a full disk says the latter
        cause = cause.__cause__ or cause.__context__
    return False


class CheckpointManager:
    """Saves, lists, prunes and finds the checkpoints under one `checkpoints/` folder."""

    def __init__(self, root: str | os.PathLike[str], max_to_keep: int | None = None) -> None:
        self.root = Path(root)
        self.max_to_keep = max_to_keep

    def steps(self) -> list[Path]:
        """Complete step directories, oldest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if p.is_dir() and is_complete(p)]
        return sorted(found, key=lambda p: step_of(p) or 0)

    def latest(self) -> Path | None:
        """The checkpoint `latest` names, or else the newest complete one."""
        marker = self.root / LATEST
        if marker.is_file():
            path = self.root / marker.read_text().strip()
            if is_complete(path):
                return path
        steps = self.steps()
        return steps[-1] if steps else None

    def stale_marker(self) -> str | None:
        """A warning when `latest` names a step that is gone or incomplete (deleted by
        hand, say), naming it and the checkpoint `latest()` falls back to; else None."""
        marker = self.root / LATEST
        if not marker.is_file():
            return None
        named = marker.read_text().strip()
        if is_complete(self.root / named):
            return None
        steps = self.steps()
        fallback = (
            f"the newest complete checkpoint, {steps[-1]}, is used instead"
            if steps
            else "no complete checkpoint is left: the run starts from step 0"
        )
        return f"{marker} names {named!r}, which is missing or incomplete; {fallback}"

    def resolve(self, mode: str, path: str | os.PathLike[str] | None = None) -> Path | None:
        """`trainer.resume_mode`: "auto" (the latest checkpoint here, if any), "disable",
        or "resume_path" (`trainer.resume_from_path`, a global_step_N directory)."""
        if mode == "disable":
            return None
        if mode == "auto":
            return self.latest()
        if path is None or not is_complete(Path(path)):
            raise FileNotFoundError(
                f"trainer.resume_from_path={path}: not a complete checkpoint directory "
                f"(expected checkpoints/global_step_N with {STATE_FILE})"
            )
        return Path(path)

    def save(
        self,
        step: int,
        states: dict[str, Any],
        write: Callable[[Path], None],
        fingerprint: dict[str, Any] | None = None,
    ) -> Path:
        """Write checkpoint `global_step_<step>` atomically.

        `write(tmp_dir)` has the roles write their parts; then the driver parts'
        `states` and the manifest (every file, and the run's `fingerprint`) go in, the
        directory is renamed into place, `latest` is updated, and old ones are pruned.
        A full disk or a read-only filesystem raises CheckpointWriteError with the path
        and the bytes needed; the partial directory is removed, the last checkpoint stays.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        self.clean_partial()
        self._check_space()
        name = f"global_step_{step}"
        tmp = self.root / f".tmp-{name}-{uuid.uuid4().hex[:8]}"
        try:
            tmp.mkdir()
            write(tmp)
            torch.save(states, tmp / STATE_FILE)
            write_manifest(tmp, fingerprint or {})
        except Exception as err:
            named = self._write_error(tmp, err)
            if named is err:
                raise
            raise named from err
        final = self.root / name
        if final.exists():  # the same step saved again (a run restarted without resume)
            shutil.rmtree(final)
        tmp.rename(final)
        _write_atomic(self.root / LATEST, name + "\n")
        self.prune()
        return final

    def _check_space(self) -> None:
        """Refuse to start a save that cannot fit: the last checkpoint's size is the
        estimate of the next one's."""
        last = self.latest()
        if last is None:
            return
        need, free = _dir_bytes(last), shutil.disk_usage(self.root).free
        if need > free:
            raise CheckpointWriteError(
                f"not enough space for a checkpoint under {self.root}: about {need:,} bytes "
                f"needed (the size of {last.name}), {free:,} free. Free space there, keep "
                "fewer checkpoints (trainer.max_actor_ckpt_to_keep), or set "
                "trainer.output_dir to a larger disk"
            )

    def _write_error(self, tmp: Path, err: Exception) -> Exception:
        """A CheckpointWriteError for a full disk or a read-only filesystem (the partial
        directory removed); any other error as it is."""
        written = _dir_bytes(tmp) if tmp.exists() else 0
        shutil.rmtree(tmp, ignore_errors=True)
        free = shutil.disk_usage(self.root).free
        if _out_of_space(err):
            return CheckpointWriteError(
                f"the disk under {self.root} is full: the checkpoint ran out of space after "
                f"{written:,} bytes ({free:,} free now; it needs more than that). Free space "
                "there or set trainer.output_dir to a larger disk; the last complete "
                f"checkpoint ({self.latest() or 'none'}) is intact"
            )
        if isinstance(err, OSError) and err.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return CheckpointWriteError(
                f"cannot write a checkpoint under {self.root}: {err.strerror} "
                f"({err.filename}); set trainer.output_dir to a writable directory"
            )
        return err

    def prune(self) -> list[Path]:
        """Remove all but the newest `max_to_keep` complete checkpoints."""
        if not self.max_to_keep:
            return []
        steps = self.steps()
        removed = steps[: max(0, len(steps) - self.max_to_keep)]
        for path in removed:
            shutil.rmtree(path, ignore_errors=True)
        return removed

    def clean_partial(self) -> None:
        """Remove what saves that died half-way left behind."""
        if self.root.is_dir():
            for path in self.root.glob(".tmp-global_step_*"):
                shutil.rmtree(path, ignore_errors=True)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
