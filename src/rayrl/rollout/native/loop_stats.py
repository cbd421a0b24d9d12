"""The native engine's account of one generation loop (`last_stats`): its steps and
tokens, and where the loop's time went, for benches and profiles to read."""

from __future__ import annotations

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
