"""Shared pieces of the asynchronous-training tests: a killer of rollout replicas."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

import ray

from rayrl.trainer.run import Run


def generating(beat: dict) -> bool:
    """The replica is inside `generate`."""
    return (beat.get("busy") or "").endswith("generate")


def tools_running(beat: dict) -> bool:
    """One of the replica's episodes is running its tools."""
    return beat.get("phase") == "tools"


class ReplicaKiller:
    """SIGKILLs the first rollout replica's process once, from step `after_step` on, at
    the first heartbeat for which `at(beat)` holds."""

    def __init__(self, run: Run, after_step: int, at: Callable[[dict], bool] = generating) -> None:
        self.run, self.after_step, self.at = run, after_step, at
        self.killed: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set() and not self.killed:
            time.sleep(0.005)
            if self.run.progress.global_step < self.after_step:
                continue
            replicas = self.run.trainer.rollouts.replicas
            actor = replicas[0].group.actors[0] if replicas else None
            try:
                beat = ray.get(actor.heartbeat.remote(), timeout=2) if actor else None
            except Exception:  # noqa: BLE001 - being replaced: look again
                continue
            if beat and self.at(beat):
                os.kill(beat["pid"], signal.SIGKILL)
                self.killed.append(beat["pid"])

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
