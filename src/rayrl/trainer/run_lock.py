"""One run per run directory: an exclusive lock on `OUTPUT_DIR/.rayrl.lock`.

Two runs writing one `trainer.output_dir` would resume from each other's checkpoints,
interleave their rows in metrics.jsonl and overwrite each other's step directories.
`RunLock` takes an exclusive `flock` on the lock file for the whole run and writes who
holds it (host, pid, run name, start time) into it; a second run on the same directory
fails at once with that holder in its message. The kernel releases the lock when the
holding process ends, however it ends (SIGKILL included), so a crashed run never
leaves a stale lock behind. (`flock` is per host: on a network filesystem, runs on two
machines are only kept apart where the filesystem supports it.)
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any, cast

LOCK_FILE = ".rayrl.lock"


class RunDirLockedError(RuntimeError):
    """Another run holds the run directory."""


class RunLock:
    """The exclusive lock of one run directory (module docstring)."""

    def __init__(self, root: Path) -> None:
        self.path = Path(root) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self, run: str) -> RunLock:
        """Take the lock for run `run`, or raise RunDirLockedError naming the holder."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            raise RunDirLockedError(
                f"trainer.output_dir={self.path.parent} is in use by another run "
                f"({_describe(holder)}); two runs in one directory would overwrite each "
                "other's checkpoints and metrics. Wait for it to end, stop it, or set "
                "trainer.output_dir to another directory."
            ) from None
        holder = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "run": run,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Let the directory go (the file stays; only the lock on it matters)."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None


def _read(fd: int) -> dict[str, Any]:
    try:
        return cast("dict[str, Any]", json.loads(os.pread(fd, 4096, 0).decode() or "{}"))
    except (OSError, ValueError):
        return {}


def _describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "holder unknown"
    return (
        f"run {holder.get('run', '?')}, pid {holder.get('pid', '?')} on host "
        f"{holder.get('host', '?')}, started {holder.get('started', '?')}"
    )
