"""Multi-turn episodes on a tensor-parallel replica: TP rank 0 drives, the others follow.

The ranks of a replica run one deterministic schedule in lockstep
(`rayrl.rollout.native.tp`). A multi-turn rollout adds a source of decisions
that is neither deterministic nor the same on every rank: the environments and tools
(they may time out, sample, run a sandboxed subprocess, or count their calls), and the
moment their answers are ready. So only TP rank 0 has a turn driver that runs them;
every rank wraps its driver in `LockstepTurns`, which the engine's loop calls at the
same points on every rank (they follow from the shared schedule):

- ``turn_ended`` reaches the real driver on TP rank 0 only; the others do nothing;
- ``take_ready`` asks TP rank 0's driver for the answers ready now (or, when the
  schedule has nothing else to run, waits for one), broadcasts how many there are and,
  when there are some, the answers themselves; every rank returns TP rank 0's list,
  so every rank resumes or ends the same samples with the same tokens at the same step.
  A wait lasts at most ``WAIT_SLICE_S`` (then an empty list: the engine's loop comes
  back and waits again), so that the other ranks never sit in one collective for as
  long as a slow tool runs (NCCL would time the collective out).

A driver that fails on TP rank 0 is reported to the other ranks (they raise too,
naming it) rather than leaving them waiting in a collective. The ranks other than 0
hand their engine `FollowerTurns`: it is never asked for anything.
"""

from __future__ import annotations

import time

import numpy as np

from rayrl.rollout.native.tp import TensorParallel
from rayrl.rollout.turns import Continuation, TurnDriver

__all__ = ["FollowerTurns", "LockstepTurns"]

_FAILED = -1
WAIT_SLICE_S = 5.0


class FollowerTurns:
    """The driver of a TP rank other than 0: the episodes are TP rank 0's."""

    def turn_ended(self, sample: int, response: np.ndarray) -> None:
        return None

    def take_ready(self, wait: bool) -> list[Continuation]:
        raise RuntimeError(
            "multi-turn rollout: a TP rank other than 0 was asked for tool answers; only TP "
            "rank 0 runs the environments (rayrl.rollout.native.tp_turns)"
        )


class LockstepTurns:
    """A turn driver shared by the ranks of a replica (see the module docstring)."""

    def __init__(self, driver: TurnDriver, tp: TensorParallel) -> None:
        self.driver, self.tp = driver, tp
        self.leads = tp.rank == 0

    def turn_ended(self, sample: int, response: np.ndarray) -> None:
        if self.leads:
            self.driver.turn_ended(sample, response)

    def take_ready(self, wait: bool) -> list[Continuation]:
        if not self.leads:
            return self._receive()
        try:
            answers = self._poll() if wait else self.driver.take_ready(False)
        except BaseException as err:
            self.tp.broadcast_count(_FAILED)
            self.tp.broadcast_object(f"{type(err).__name__}: {err}")
            raise
        self.tp.broadcast_count(len(answers))
        if answers:
            self.tp.broadcast_object([_plain(a) for a in answers])
        return answers

    def _poll(self) -> list[Continuation]:
        """TP rank 0's answers, waiting for one at most `WAIT_SLICE_S`."""
        deadline = time.monotonic() + WAIT_SLICE_S
        while True:
            answers = self.driver.take_ready(False)
            if answers or time.monotonic() >= deadline:
                return answers
            time.sleep(0.002)

    def _receive(self) -> list[Continuation]:
        count = self.tp.broadcast_count(0)
        if count == _FAILED:
            error = self.tp.broadcast_object(None)
            raise RuntimeError(
                f"native rollout engine (TP rank {self.tp.rank} of {self.tp.size}): the turn "
                f"driver of TP rank 0 failed ({error}); see TP rank 0's log"
            )
        if count == 0:
            return []
        return [Continuation(*fields) for fields in self.tp.broadcast_object(None)]


def _plain(answer: Continuation) -> tuple[int, list[int] | None, bool]:
    tokens = None if answer.tokens is None else [int(t) for t in answer.tokens]
    return int(answer.sample), tokens, bool(answer.stopped)
