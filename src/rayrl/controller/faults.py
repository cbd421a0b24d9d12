"""Faults armed in workers on purpose, to prove that a run survives them.

    group.inject(Fault("compute_log_prob", "kill", ranks=(1,)))   # once, in rank 1
    group.inject(Fault("update_actor", "hang"))                   # every rank, once
    group.inject(Fault("generate", "kill", times=None))           # every call, forever

A fault fires at the start of a registered method (`@register` runs `fire`) or of
`init_worker` (its `method` is then "init_worker"), after
`after_s` seconds: `kill` SIGKILLs the worker's own process (what an OOM killer or a
lost machine does), `hang` sleeps forever in the call (a stuck collective, a deadlock),
`raise` raises RuntimeError. A fault with `times=None` is kept by the group and armed
again in every worker that replaces one, so a rank that always dies at the same point
can be shown to hit `trainer.max_worker_restarts`. Nothing fires unless armed.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass

ACTIONS = ("kill", "hang", "raise")


@dataclass(frozen=True)
class Fault:
    """What to do at the start of `method` (a registered method's name), on which ranks
    (None: all), how many times per worker (None: every call, in replacements too)."""

    method: str
    action: str = "kill"
    ranks: tuple[int, ...] | None = None
    times: int | None = 1
    after_s: float = 0.0

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"Fault action must be one of {ACTIONS}; got {self.action!r}")

    def applies_to(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks


# Faults armed in this process, with the calls each has left (None: unlimited).
_ARMED: list[list] = []
_LOCK = threading.Lock()


def arm(faults: list[Fault], rank: int) -> int:
    """Arm the faults that apply to `rank` in this process; returns how many."""
    with _LOCK:
        for fault in faults:
            if fault.applies_to(rank):
                _ARMED.append([fault, fault.times])
        return len(_ARMED)


def disarm() -> None:
    """Forget every armed fault of this process."""
    with _LOCK:
        _ARMED.clear()


def fire(method: str) -> None:
    """Called at the start of registered method `method`: run an armed fault, if any."""
    if not _ARMED:
        return
    with _LOCK:
        entry = next((e for e in _ARMED if e[0].method == method and e[1] != 0), None)
        if entry is None:
            return
        if entry[1] is not None:
            entry[1] -= 1
    fault: Fault = entry[0]
    if fault.after_s > 0:
        time.sleep(fault.after_s)
    if fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.action == "hang":
        _hang_forever()
    else:
        raise RuntimeError(f"fault injected into {method} (rayrl.controller.faults)")


def _hang_forever() -> None:
    while True:  # the watchdog reports this frame, then the worker is killed
        time.sleep(3600)
