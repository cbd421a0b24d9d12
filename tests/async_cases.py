"""Shared pieces of the asynchronous-training tests: a small multi-turn run with the
bench's tool environment (`SMALL`), its asynchronous settings that train exactly what
the synchronous run does (`EXACT`), and a killer of rollout replicas."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import ray

from rayrl.trainer.run import Run

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
from _agent_env import ENVIRONMENT, end_turns_often  # noqa: E402

__all__ = [
    "EXACT",
    "SMALL",
    "ReplicaKiller",
    "end_turns_often",  # the bench's: a model whose turns end often (tool calls)
    "generating",
    "tools_running",
]
MT = "actor_rollout_ref.rollout.multi_turn"
SMALL = [
    "data.train_batch_size=2",
    "data.max_response_length=40",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "trainer.device=cpu",
    "trainer.val_before_train=false",
    "trainer.logger=[jsonl]",
    "trainer.total_training_steps=3",
    "trainer.resume_mode=disable",
    f"{MT}.enable=true",
    f"actor_rollout_ref.rollout.agent.default_agent_loop={BENCH / '_agent_env.py'}:{ENVIRONMENT}",
    f"{MT}.environment_config.latency_s=0.15",
    f"{MT}.environment_config.calls=2",
    f"{MT}.max_tool_response_length=8",
]
EXACT = [
    "actor_rollout_ref.rollout.mode=async",
    "rollout.n_gpus_per_node=1",
    "async_training.trigger_parameter_sync_step=1",
    "async_training.staleness_threshold=0",
    "async_training.partial_rollout=false",
]


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
