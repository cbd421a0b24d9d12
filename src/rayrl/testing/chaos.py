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
kills at that later point instead; when the step ends first (or the rank's heartbeat
does not answer, or its process is gone before the signal), the kill is tried again
at the next step, at a new point, and the miss is kept with its reason. A planned kill
that never lands (no step left) is listed with why in `plan` (`rayrl.testing.
kill_plan`): a report never holds fewer kills than planned without saying which and why.
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from rayrl.testing.kill_plan import Attempt, KillPlan

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
    (see the module doc). It reads the run's progress and replay, and its trainer's roles.

    Its accounts are `plan` (`rayrl.testing.kill_plan.KillPlan`): a kill that misses
    its step is tried again at the next, and one that never lands is listed with why
    (`plan.ok`, `plan.report()`, `plan.lines()`); `done` holds the kills that landed,
    `missed` every miss, `error` what stopped the monkey if anything did."""

    run: Any
    seed: int = 0
    stages: list[str] = field(default_factory=lambda: list(DEFAULT_STAGES))
    kills: int = 10
    steps: list[int] | None = None  # the steps it may kill in (None: any)
    poll_s: float = 0.005
    jitter_s: float = 0.01
    idle_s: float = 0.05  # between looks while no step may be killed in
    heartbeat_timeout_s: float = 2.0
    signal_fn: Callable[[int, int], None] = os.kill

    def __post_init__(self) -> None:
        unknown = sorted(set(self.stages) - set(POINTS))
        if unknown:
            raise ValueError(f"unknown chaos stages {unknown}; known: {sorted(POINTS)}")
        self.rng = random.Random(self.seed)
        self.view = RunView(self.run)
        self.plan = KillPlan(self.kills)
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rayrl-chaos", daemon=True)

    @property
    def done(self) -> list[Kill]:
        """The kills that landed, in order."""
        return self.plan.done

    @property
    def missed(self) -> list[Attempt]:
        """Every try that missed its step (each re-planned into a later step)."""
        return self.plan.attempts

    def start(self) -> ChaosMonkey:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for line in self.plan.lines():
            log.warning("chaos: %s", line)

    def _loop(self) -> None:
        why = ""
        try:
            while not self._stop.is_set() and self.plan.current is not None:
                step = self.view.step()
                allowed = (self.steps is None or step in self.steps) and (
                    step < self.view.total_steps()
                )
                waiting = self.done and self.done[-1].step >= step
                if not allowed or waiting or not self.view.started():
                    time.sleep(self.idle_s)
                    continue
                stage = self.rng.choice(self.stages)  # a new point each step, hit or missed
                self._attempt(step, stage)
        except Exception as err:  # noqa: BLE001 - said in the plan, never a silent end
            self.error = err
            log.exception("chaos: the monkey stopped")
            why = f"the monkey failed: {type(err).__name__}: {_first_line(err)}"
        finally:
            self.plan.finish(why or self._why_ended())

    def _attempt(self, step: int, stage: str) -> None:
        current = self.plan.current
        assert current is not None  # `_loop` attempts only while a planned kill is left
        number = current.number
        kill, reason = self._try(step, stage)
        if kill is not None:
            self.plan.landed(kill)
            log.warning(
                "chaos: killed %s rank %d (pid %d) in %s of step %d",
                kill.group,
                kill.rank,
                kill.pid,
                kill.stage,
                step,
            )
            return
        self.plan.missed(step, stage, reason)
        log.warning(
            "chaos: planned kill %d of %d missed step %d (%s): %s; tried again at the next",
            number,
            self.kills,
            step,
            stage,
            reason,
        )

    def _why_ended(self) -> str:
        """Why planned kills are left when the loop ends."""
        try:
            step, total = self.view.step(), self.view.total_steps()
        except Exception as err:  # noqa: BLE001 - the run is gone: say so
            return f"the run could not be read ({type(err).__name__}: {_first_line(err)})"
        if step >= total:
            return (
                f"the run ended ({total} steps) with no step left to try it in (at most "
                "one kill a step)"
            )
        if self.steps is not None and not any(s >= step for s in self.steps):
            return f"no step it may kill in is left (steps {self.steps}; now step {step})"
        return f"the monkey was stopped at step {step} of {total}"

    def _try(self, step: int, stage: str) -> tuple[Kill | None, str]:
        """Watch for `stage` during `step`; kill there. (None, why) when it did not.

        A hybrid point seen to have passed (a short weight sync between two polls) moves
        the kill forward to the allowed point the rank is in now, in the same step."""
        role, method, phase = POINTS[stage]
        group = self.view.group(role)
        rank = self.rng.randrange(group.world_size)
        wait_s = self.rng.uniform(0, self.jitter_s)
        seen: list[str] = []  # where the rank was seen, each place once, in order
        trouble = ""
        while not self._stop.is_set() and self.view.step() == step:
            actor = group.actors[rank]
            beat, trouble = self._heartbeat(actor, trouble)
            if beat and _where(beat) not in seen:
                seen.append(_where(beat))
            later = beat and role == "hybrid" and self._later_point(beat, stage)
            if later:
                stage, (_, method, phase) = later, POINTS[later]
            if beat and _at(beat, method, phase):
                time.sleep(wait_s)  # a random moment into it, if it still runs then
                again, trouble = self._heartbeat(actor, trouble)
                if again and _at(again, method, phase):
                    return self._kill(step, stage, group.name, rank, beat["pid"])
                wait_s = 0.0
            time.sleep(self.poll_s)
        if self._stop.is_set():
            return None, f"the monkey was stopped during step {step}"
        where = f"{method}/{phase}" if phase else method
        last = f"seen in {', '.join(seen)}" if seen else "never seen"
        heartbeat = f"; its heartbeat: {trouble}" if trouble else ""
        return None, (
            f"the step ended before {group.name} rank {rank} was seen in {where} "
            f"({last}{heartbeat})"
        )

    def _kill(
        self, step: int, stage: str, group: str, rank: int, pid: int
    ) -> tuple[Kill | None, str]:
        try:
            self.signal_fn(pid, signal.SIGKILL)
        except OSError as err:  # gone already (being replaced): the next step tries again
            return None, f"{group} rank {rank} (pid {pid}) was gone before the kill ({err})"
        return Kill(step, stage, group, rank, pid, time.time()), ""

    def _heartbeat(self, actor: Any, trouble: str) -> tuple[dict | None, str]:
        """The rank's heartbeat, or None and what went wrong (a rank being replaced has
        no actor; a loaded machine may not answer in time)."""
        if actor is None:
            return None, "no process (being replaced)"
        try:
            return ray.get(actor.heartbeat.remote(), timeout=self.heartbeat_timeout_s), trouble
        except Exception as err:  # noqa: BLE001 - look again; said if the step ends first
            return None, f"{type(err).__name__}: {_first_line(err)}"

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


def _where(beat: dict) -> str:
    """Where a heartbeat says the rank is: its method and sub-phase, or idle."""
    busy = (beat.get("busy") or "").rsplit(".", 1)[-1] or "idle"
    return f"{busy}/{beat['phase']}" if beat.get("phase") else busy


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else ""


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
