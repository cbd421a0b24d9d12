"""The native engine's account of its work: its loop's counters since it started
(`stats`), and one generation's share of them (`last_stats`: its steps and tokens,
where the loop's time went), for benches, profiles and metrics to read."""

from __future__ import annotations

import time
from typing import Any

# The seconds kept, rounded to 0.1 ms when the loop ends
TIMED = (
    "run_s",
    "wait_s",
    "prefill_s",
    "prefill_forward_s",
    "prefill_wait_s",
    "launch_s",
    "commit_s",
    "turn_wait_s",
    "turns_s",
    "graph_capture_s",
)


def loop_stats(with_turns: bool) -> dict[str, Any]:
    """The counters of a loop that starts (`with_turns`: multi-turn episodes)."""
    stats: dict[str, Any] = {
        "prefill_steps": 0,
        "prefill_tokens": 0,
        "prefill_graph_steps": 0,  # of prefill_steps: replays of a captured graph
        "decode_steps": 0,
        "overlapped_steps": 0,
        "dropped_tokens": 0,
        # Where the loop's time goes: prefill steps (planned, run, sampled and
        # committed), decode launches (planned, inputs staged, queued), commits
        # (waiting for a step's tokens included), and the turn driver's answers.
        "prefill_s": 0.0,
        # Of prefill_s: queueing the forwards (eager: every kernel launched from
        # Python; a graph: its inputs staged and one replay), and waiting for their
        # drawn tokens (the device's time not hidden behind that queueing).
        "prefill_forward_s": 0.0,
        "prefill_wait_s": 0.0,
        "launch_s": 0.0,
        "commit_s": 0.0,
    }
    if with_turns:
        # Of prefill_steps: queued behind a decode step in flight, their tokens left on
        # the device for the next decode step (`Stepper._prefill`).
        stats["overlapped_prefills"] = 0
        stats["turn_wait_s"] = 0.0  # blocked on the driver with nothing to run
        stats["turns_s"] = 0.0  # taking and applying the driver's answers otherwise
    return stats


def finished_stats(stats: dict[str, Any], with_turns: bool) -> dict[str, Any]:
    """A finished generation's stats (the engine's counters' growth over it): seconds
    rounded; without multi-turn episodes, the turn counters left out."""
    out = {k: round(v, 4) if k in TIMED else v for k, v in stats.items()}
    if not with_turns:
        for key in (
            "overlapped_prefills",
            "turn_wait_s",
            "turns_s",
            "resumed_turns",
            "reclaimed_kv",
        ):
            out.pop(key, None)
    return out


def engine_counters(engine: Any) -> dict[str, float]:
    """A native engine's counters now: its loop's (`stats`), its graphs' captures, its
    scheduler's (preemptions, resumed turns, reclaimed KV) and its prefix cache's."""
    sched, prefix = engine.sched, engine.prefix
    scheduler = {
        "preemptions": sched.preemptions,
        "resumed_turns": sched.resumes,
        "reclaimed_kv": sched.reclaimed,
        "prefix_hit_tokens": prefix.hit_tokens if prefix else 0,
        "prefix_tokens": prefix.looked_tokens if prefix else 0,
    }
    return {**engine.stats, **graph_counts(engine.runner), **scheduler}


def call_stats(
    engine: Any, before: dict, start: float, timing: dict, with_turns: bool
) -> dict[str, Any]:
    """One generation's stats (`last_stats`): the counters' growth over it, its
    seconds, the time blocked on the device's results (`wait_s`; the rest of `run_s`
    is host work the device waited for) and on the turn driver (``timing``)."""
    after = engine_counters(engine)
    stats = {k: v - before.get(k, 0) for k, v in after.items()}
    stats["run_s"] = time.perf_counter() - start
    stats["wait_s"] = engine.runner.sampler.wait_s
    stats.update(timing)
    return finished_stats(stats, with_turns=with_turns)


def graph_counts(runner: Any) -> dict[str, float]:
    """So far, by the runner's `DecodeGraphs` and `PrefillGraphs`: the graphs captured,
    the seconds their captures took, and the prefill steps replayed from a graph."""
    graphs = [g for g in (runner.graphs, runner.prefill_graphs) if g is not None]
    prefill = runner.prefill_graphs
    return {
        "graph_captures": sum(g.captures for g in graphs),
        "graph_capture_s": sum(g.capture_s for g in graphs),
        "prefill_graph_steps": prefill.replays if prefill is not None else 0,
    }
