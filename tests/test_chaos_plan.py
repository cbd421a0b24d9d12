"""The chaos monkey's planning and accounts, with a scripted run and no Ray: a kill that
misses its step (the step ended first, the heartbeat did not answer, the process was
gone) is tried again at the next step, with the miss and its reason kept; planned kills
that no step is left for are listed one by one with why; the monkey never ends with
fewer kills than planned without saying which and why, and never stops silently.

The run is a timeline the monkey's own reads advance (each heartbeat and each look at
the step moves it one tick), so the test is the same on a loaded machine."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from rayrl.testing import chaos
from rayrl.testing.chaos import ChaosMonkey
from rayrl.testing.kill_plan import KillPlan

# a step as the hybrid rank's heartbeat shows it: (method, phase), TICKS ticks each
HYBRID_STEP = [
    ("generate", "weight_sync"),
    ("generate", None),
    ("compute_log_prob", None),
    ("update_actor", None),
]
TICKS = 4


class ScriptedRun:
    """The run's steps, phases and processes, advanced by the monkey's reads."""

    def __init__(
        self,
        steps: int,
        fail_heartbeats: set[int] = frozenset(),
        gone: int = 0,
        tools: set[int] = frozenset(),
    ):
        self.steps, self.step, self.tick = steps, 0, 0
        self.tools = set(tools)  # the steps whose generation runs tool calls
        self.fail_heartbeats = set(fail_heartbeats)  # the ticks whose heartbeat times out
        self.gone = gone  # kills whose process has already exited
        self.killed: list[tuple[int, int]] = []  # (step, pid)
        self.ended = threading.Event()
        self.reads = 0

    def advance(self) -> None:
        self.reads += 1
        self.tick += 1
        if self.tick >= TICKS * len(HYBRID_STEP):
            self.step, self.tick = self.step + 1, 0
            if self.step >= self.steps:
                self.ended.set()

    def beat(self, role: str, rank: int) -> dict:
        if self.reads in self.fail_heartbeats:
            self.advance()
            raise TimeoutError("the heartbeat took more than 2 s (planted)")
        self.advance()
        method, phase = HYBRID_STEP[min(self.tick // TICKS, len(HYBRID_STEP) - 1)]
        if self.step in self.tools and (method, phase) == ("generate", None):
            phase = "tools"
        if role == "reward":
            method, phase = ("compute_score", None) if method == "compute_log_prob" else ("", None)
        return {"busy": f"Worker.{method}" if method else None, "phase": phase, "pid": 1000 + rank}

    def kill(self, pid: int, sig: int) -> None:
        if self.gone:
            self.gone -= 1
            raise ProcessLookupError(3, "No such process")
        self.killed.append((self.step, pid))
        self.step, self.tick = self.step + 1, 0  # the step recovers and finishes
        if self.step >= self.steps:
            self.ended.set()


class ScriptedView:
    def __init__(self, run: ScriptedRun) -> None:
        self.run = run

    def step(self) -> int:
        if self.run.step < self.run.steps:
            self.run.advance()
        return self.run.step

    def total_steps(self) -> int:
        return self.run.steps

    def started(self) -> bool:
        return True

    def group(self, name: str):
        actors = [
            SimpleNamespace(heartbeat=SimpleNamespace(remote=lambda r=r: (name, r)))
            for r in range(2)
        ]
        return SimpleNamespace(name=name, world_size=2, actors=actors)


def monkey_on(run: ScriptedRun, monkeypatch, **kwargs) -> ChaosMonkey:
    monkeypatch.setattr(chaos, "ray", SimpleNamespace(get=lambda ref, timeout: run.beat(*ref)))
    monkey = ChaosMonkey(None, poll_s=0, jitter_s=0, idle_s=0, signal_fn=run.kill, **kwargs)
    monkey.view = ScriptedView(run)
    return monkey


def play(run: ScriptedRun, monkey: ChaosMonkey) -> ChaosMonkey:
    """The monkey over the run, until the run ends (then it is stopped, as a harness
    stops it when fit() returns) or it has nothing left to do."""
    monkey.start()
    deadline = time.monotonic() + 20
    while monkey._thread.is_alive() and not run.ended.is_set() and time.monotonic() < deadline:
        time.sleep(0.001)
    monkey.stop()
    assert not monkey._thread.is_alive()
    return monkey


def accounts_add_up(monkey: ChaosMonkey, run: ScriptedRun) -> None:
    """Every planned kill landed or is listed with why; what landed was signalled."""
    report = monkey.plan.report()
    assert report["planned"] == monkey.kills
    assert report["landed"] + len(report["not_landed"]) == monkey.kills
    assert [(k.step, k.pid) for k in monkey.done] == run.killed
    assert all(entry["why"] for entry in report["not_landed"])
    assert report["ok"] == (report["landed"] == monkey.kills)
    assert len(monkey.plan.lines()) == len(report["not_landed"])


def test_every_planned_kill_lands_when_each_step_reaches_its_point(monkeypatch):
    run = ScriptedRun(steps=6)
    monkey = play(run, monkey_on(run, monkeypatch, kills=6, stages=["gen", "update", "reward"]))
    accounts_add_up(monkey, run)
    assert monkey.plan.ok and len(monkey.done) == 6 and not monkey.missed
    assert [k.step for k in monkey.done] == list(range(6))


def test_a_missed_step_is_tried_again_and_said_with_its_reason(monkeypatch):
    """Tool calls run in steps 2 and 4 only: the kill drawn for them misses steps 0, 1
    and 3 (each miss kept with its step and why) and lands in 2 and 4."""
    run = ScriptedRun(steps=6, tools={2, 4})
    monkey = play(run, monkey_on(run, monkeypatch, kills=2, stages=["tools"]))
    accounts_add_up(monkey, run)
    assert monkey.plan.ok and [k.step for k in monkey.done] == [2, 4]
    assert [(m.step, m.stage) for m in monkey.missed] == [(0, "tools"), (1, "tools"), (3, "tools")]
    for miss in monkey.missed:
        assert "the step ended before hybrid rank" in miss.reason
        assert "generate/tools" in miss.reason
        assert "seen in generate/weight_sync, generate, compute_log_prob, update_actor" in (
            miss.reason
        )
    assert [len(p.attempts) for p in monkey.plan.planned] == [2, 1]


def test_planned_kills_no_step_is_left_for_are_listed_with_why(monkeypatch):
    """More kills planned than steps that can take one: the harness once reported 9 of
    10 and nothing else. Now each kill that did not land is named with its misses and
    the end of the run, and the plan is not ok."""
    run = ScriptedRun(steps=5, tools={1})
    monkey = play(run, monkey_on(run, monkeypatch, kills=3, stages=["tools"]))
    accounts_add_up(monkey, run)
    assert not monkey.plan.ok and [k.step for k in monkey.done] == [1]
    assert [p.number for p in monkey.plan.not_landed] == [2, 3]
    first, second = monkey.plan.lines()
    assert first.startswith("planned kill 2 of 3 did not land (step 2 (tools): the step ended")
    assert "step 4 (tools)" in first and "the run ended (5 steps) with no step left" in first
    assert second == "planned kill 3 of 3 did not land (never tried): " + (
        "the run ended (5 steps) with no step left to try it in (at most one kill a step)"
    )


def test_a_silent_heartbeat_or_a_process_gone_is_a_miss_not_the_monkeys_end(monkeypatch):
    """A heartbeat that times out on a loaded machine (once it ended the monkey's
    thread, and every kill after it, without a word) and a process that exited before
    the signal are misses with their reasons; the kills land at later steps."""
    run = ScriptedRun(steps=8, fail_heartbeats=set(range(40)), gone=1)
    monkey = play(run, monkey_on(run, monkeypatch, kills=2, stages=["update"]))
    accounts_add_up(monkey, run)
    assert monkey.error is None and monkey.plan.ok
    reasons = [m.reason for m in monkey.missed]
    assert any("TimeoutError: the heartbeat took more than 2 s" in r for r in reasons), reasons
    assert any("was gone before the kill" in r and "No such process" in r for r in reasons)


def test_a_monkey_that_fails_says_so_for_every_kill_left(monkeypatch):
    run = ScriptedRun(steps=4)
    monkey = monkey_on(run, monkeypatch, kills=3, stages=["update"])

    def broken(name):
        raise RuntimeError("the run has no hybrid group (planted)")

    monkey.view.group = broken
    monkey.start()
    monkey._thread.join(10)
    monkey.stop()
    assert isinstance(monkey.error, RuntimeError)
    assert [p.why_not for p in monkey.plan.not_landed] == [
        "the monkey failed: RuntimeError: the run has no hybrid group (planted)"
    ] * 3


def test_the_plan_counts_and_refuses_a_kill_beyond_it():
    plan = KillPlan(2)
    plan.missed(0, "gen", "the step ended first")
    plan.landed("k1")
    plan.landed("k2")
    assert plan.ok and plan.done == ["k1", "k2"] and len(plan.attempts) == 1
    with pytest.raises(RuntimeError, match="after all 2 planned ones landed"):
        plan.landed("k3")
    plan.finish("the run ended")
    assert plan.lines() == []


def test_the_first_reason_a_plan_ended_for_stands():
    """The run ends, then the monkey is stopped: the kills that did not land keep the
    first reason (the run's end), not the later one."""
    plan = KillPlan(2)
    plan.landed("k1")
    plan.finish("the run ended (3 steps) with no step left")
    plan.finish("the monkey was stopped")
    assert plan.ended == "the run ended (3 steps) with no step left"
    assert plan.report()["not_landed"] == [
        {"kill": 2, "attempts": [], "why": "the run ended (3 steps) with no step left"}
    ]
