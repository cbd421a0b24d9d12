"""Chaos: SIGKILL worker processes by pid at random points of a run, and compare.

    monkey = ChaosMonkey(run, seed=0, stages=["gen", "update"], kills=2).start()
    run.fit()
    monkey.stop()          # monkey.done: what was killed, where and when

The monkey is a driver thread. For each kill it draws a stage (generation, weight
sync, tool calls of a multi-turn generation, reward, log-prob, update) and a rank of
the group that runs it, watches that rank's heartbeat (its health thread reports the
method it is in and the sub-phase, such as `weight_sync`, or `tools` while an
episode's environment step runs), and once the rank is inside that point of the current step it
waits a random moment and sends SIGKILL to its pid, as an OOM killer or a lost
machine would. It kills at most once per step. When the rank is seen in a later call
of the step than the point drawn (a short weight sync passed between two polls), it
kills at that later point instead; when the step ends first, the next step draws a new
point (the miss is recorded in `missed`).
`compare_runs` then checks a run that was killed against a clean run of the same seed:
final weights bitwise, every deterministic per-step metric, and the ledger of prompt
uids each step trained (none lost, none trained twice).

What the monkey reads from the run is all in `RunView`.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

log = logging.getLogger("rayrl.chaos")

# stage -> (group: "hybrid" or "reward", registered method, sub-phase or None)
POINTS: dict[str, tuple[str, str, str | None]] = {
    "gen": ("hybrid", "generate", None),
    "weight_sync": ("hybrid", "generate", "weight_sync"),
    "tools": ("hybrid", "generate", "tools"),  # multi-turn: an environment step runs
    "reward": ("reward", "compute_score", None),
    "log_prob": ("hybrid", "compute_log_prob", None),
    "update": ("hybrid", "update_actor", None),
}
# Every run has these; `tools` only multi-turn runs with environment steps.
DEFAULT_STAGES = tuple(stage for stage in POINTS if stage != "tools")
# The hybrid group's points in the order a step reaches them (reward runs beside log-prob).
HYBRID_ORDER = ("weight_sync", "gen", "tools", "log_prob", "update")
CLOCK_METRICS = ("timing_s/", "perf/", "reward/elapsed_s/")
# How far the rollout engine's token probabilities are from the actor's
# (`rollout.calculate_log_probs`): a replaced worker's fresh engine computes them with
# float32 rounding of its own (differences of about 1e-10 in probability), and on an
# AVX-512 CPU a matmul of one or two rows rounds differently from the same rows in a
# larger batch (up to 1e-5 in a logit, measured on the 2-core Intel VM), so which rows
# the engine runs together moves them too; the tokens it samples, and everything
# trained from them, stay bitwise the same. Compared within ENGINE_TOLERANCE, not
# bitwise (1e-6 before the Intel VM; its SIGTERM/resume test once exceeded that).
ENGINE_NUMERICS = ("training/rollout_probs_diff_", "training/rollout_actor_probs_pearson_corr")
ENGINE_TOLERANCE = 1e-5
# What a recovery did (`rayrl.trainer.replay`): only the steps after one have them.
RECOVERY_METRICS = ("recovery/",)


@dataclass
class Kill:
    step: int
    stage: str
    group: str
    rank: int
    pid: int
    time: float


class RunView:
    """Everything the monkey reads from a PPO run (`rayrl.trainer.run.Run` of a
    `PPOTrainer`), in one place: the step in progress, the last step, whether the run is
    under way, its hybrid and reward groups (WorkerGroup-like: `world_size`, `actors`,
    `name`) and when recoveries ended."""

    def __init__(self, run: Any) -> None:
        self.run = run

    def step(self) -> int:
        """The step in progress."""
        return self.run.progress.global_step

    def total_steps(self) -> int:
        return self.run.total_steps()

    def started(self) -> bool:
        """Whether the training loop runs (its step replay is set up)."""
        return bool(self.run.replay)

    def group(self, name: str) -> Any:
        """The "hybrid" group (actor, rollout, reference, critic) or the "reward" one."""
        roles = self.run.trainer.roles
        return roles.hybrid if name == "hybrid" else roles.reward

    def recovery_ends(self) -> list[float]:
        """When each recovery of the run ended (wall clock), in order."""
        return sorted(r["end"] for r in self.run.replay.recoveries if "end" in r)


@dataclass
class ChaosMonkey:
    """Kills `kills` workers of a PPO `run` (`rayrl.trainer.run.Run`) at random `stages`
    (see the module doc). It reads the run's progress and replay, and its trainer's roles."""

    run: Any
    seed: int = 0
    stages: list[str] = field(default_factory=lambda: list(DEFAULT_STAGES))
    kills: int = 10
    steps: list[int] | None = None  # the steps it may kill in (None: any)
    poll_s: float = 0.005
    jitter_s: float = 0.01
    done: list[Kill] = field(default_factory=list)
    missed: list[tuple[int, str]] = field(default_factory=list)  # (step, stage) not hit

    def __post_init__(self) -> None:
        unknown = sorted(set(self.stages) - set(POINTS))
        if unknown:
            raise ValueError(f"unknown chaos stages {unknown}; known: {sorted(POINTS)}")
        self.rng = random.Random(self.seed)
        self.view = RunView(self.run)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rayrl-chaos", daemon=True)

    def start(self) -> ChaosMonkey:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.is_set() and len(self.done) < self.kills:
            step = self.view.step()
            allowed = (self.steps is None or step in self.steps) and step < self.view.total_steps()
            if not allowed or self.done and self.done[-1].step >= step or not self.view.started():
                time.sleep(0.05)
                continue
            stage = self.rng.choice(self.stages)  # a new point each step, hit or missed
            kill = self._try(step, stage)
            if kill is not None:
                self.done.append(kill)
                log.warning(
                    "chaos: killed %s rank %d (pid %d) in %s of step %d",
                    kill.group,
                    kill.rank,
                    kill.pid,
                    kill.stage,
                    step,
                )
            else:
                self.missed.append((step, stage))

    def _try(self, step: int, stage: str) -> Kill | None:
        """Watch for `stage` during `step`; kill there. None when the step ended first.

        A hybrid point seen to have passed (a short weight sync between two polls) moves
        the kill forward to the allowed point the rank is in now, in the same step."""
        role, method, phase = POINTS[stage]
        group = self.view.group(role)
        rank = self.rng.randrange(group.world_size)
        wait_s = self.rng.uniform(0, self.jitter_s)
        while not self._stop.is_set() and self.view.step() == step:
            actor = group.actors[rank]
            try:
                beat = ray.get(actor.heartbeat.remote(), timeout=2.0) if actor else None
            except Exception:  # noqa: BLE001 - being replaced: look again
                beat = None
            later = beat and role == "hybrid" and self._later_point(beat, stage)
            if later:
                stage, (_, method, phase) = later, POINTS[later]
            if beat and _at(beat, method, phase):
                time.sleep(wait_s)  # a random moment into it, if it still runs then
                if _at(ray.get(actor.heartbeat.remote(), timeout=2.0), method, phase):
                    os.kill(beat["pid"], signal.SIGKILL)
                    return Kill(step, stage, group.name, rank, beat["pid"], time.time())
                wait_s = 0.0
            time.sleep(self.poll_s)
        return None

    def _later_point(self, beat: dict, stage: str) -> str | None:
        """The allowed hybrid point the heartbeat shows, when it is in a later call of
        the step than `stage` (so `stage` has passed)."""
        method = POINTS[stage][1]
        for name in HYBRID_ORDER[HYBRID_ORDER.index(stage) + 1 :]:
            if name in self.stages and POINTS[name][1] != method and _at(beat, *POINTS[name][1:]):
                return name
        return None

    def recovery_seconds(self) -> list[float]:
        """For each kill, seconds from the kill to the end of the recovery after it."""
        ends = self.view.recovery_ends()
        out = []
        for kill in self.done:
            after = [e for e in ends if e >= kill.time]
            if after:
                out.append(after[0] - kill.time)
        return out


def _at(beat: dict, method: str, phase: str | None) -> bool:
    busy = (beat.get("busy") or "").rsplit(".", 1)[-1]
    return busy == method and beat.get("phase") == phase


def deterministic(metrics: dict) -> dict:
    """A step's metrics without the wall-clock ones, the engine-numerics ones and those of
    recoveries."""
    skip = CLOCK_METRICS + ENGINE_NUMERICS + RECOVERY_METRICS
    return {k: v for k, v in metrics.items() if not k.startswith(skip)}


def engine_numerics_apart(a: dict, b: dict) -> dict[str, tuple]:
    """The `ENGINE_NUMERICS` metrics of two steps that differ by more than
    `ENGINE_TOLERANCE` (or that only one has): name -> (a's value, b's value)."""
    keys = {k for k in a.keys() | b.keys() if k.startswith(ENGINE_NUMERICS)}
    return {
        k: (a.get(k), b.get(k))
        for k in sorted(keys)
        if not (k in a and k in b and (_same(a[k], b[k]) or abs(a[k] - b[k]) <= ENGINE_TOLERANCE))
    }


def compare_runs(clean: dict, chaos: dict) -> dict[str, Any]:
    """Compare two runs' `weights` (name -> tensor), `history` and `ledger`."""
    import torch

    a, b = clean["weights"], chaos["weights"]
    same_weights = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = list(zip(clean["history"], chaos["history"], strict=False))
    differ = sorted(
        {
            k
            for x, y in rows
            for k in deterministic(x).keys() | deterministic(y).keys()
            if not _same(x.get(k), y.get(k))
        }
    )
    uids = [u for _, step_uids in chaos["ledger"] for u in step_uids]
    apart = {x.get("step"): far for x, y in rows if (far := engine_numerics_apart(x, y))}
    return {
        "weights_identical": same_weights,
        "metrics_identical": len(clean["history"]) == len(chaos["history"]) and not differ,
        "metrics_differ": differ,
        "engine_numerics_close": not apart,
        "engine_numerics_apart": apart,
        "ledger_identical": clean["ledger"] == chaos["ledger"],
        "trained_twice": sorted({u for u in uids if uids.count(u) > 1}),
    }


def _same(x: Any, y: Any) -> bool:
    return x == y or (isinstance(x, float) and isinstance(y, float) and x != x and y != y)


def final_weights(run_dir: str | Path) -> dict:
    """The exported model's weights of a finished run (`hf/model.safetensors`)."""
    from safetensors.torch import load_file

    return load_file(str(Path(run_dir) / "hf" / "model.safetensors"))
