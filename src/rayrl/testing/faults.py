"""Faults injected into workers on purpose, to prove that a run survives them.

    inject(group, Fault("compute_log_prob", "kill", ranks=(1,)))   # once, in rank 1
    inject(group, Fault("update_actor", "hang"))                   # every rank, once
    inject(group, Fault("generate", "kill", times=None))           # every call, forever

A fault is a call hook (`rayrl.controller.calls`): it runs inside the worker's own
process at the start of the named call, a registered method or one of the group's own
calls (`init_worker`, `rebuild`, ...), after `after_s` seconds. `kill` SIGKILLs the
worker's process (what an OOM killer or a lost machine does), `hang` sleeps forever in
the call (a stuck collective, a deadlock: the watchdog reports this frame), `raise`
raises RuntimeError. Each worker process counts its own `times`. A fault with
`times=None` is also installed in every worker that replaces one, so a rank that always
dies at the same point can be shown to hit `trainer.max_worker_restarts`.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rayrl.controller.group import WorkerGroup

ACTIONS = ("kill", "hang", "raise")
_LOCK = threading.Lock()


@dataclass(frozen=True)
class Fault:
    """What to do at the start of call `method` (a registered method's name, or
    "init_worker"), on which ranks (None: all), how many times per worker process
    (None: every call, in replacements too)."""

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


class FaultHook:
    """A Fault as a call hook: fires at the start of the matching calls of the ranks it
    applies to, `fault.times` times in each process (unpickled anew in each)."""

    def __init__(self, fault: Fault) -> None:
        self.fault = fault
        self.left = fault.times  # in this process; None: unlimited

    def __call__(self, worker: Any, name: str) -> None:
        fault = self.fault
        ctx = getattr(worker, "ctx", None)
        if name != fault.method or not fault.applies_to(ctx.rank if ctx else 0):
            return
        with _LOCK:  # calls on several threads count once each
            if self.left == 0:
                return
            if self.left is not None:
                self.left -= 1
        fire(fault, name)


def fire(fault: Fault, name: str) -> None:
    """Do what `fault` says, now, in this process."""
    if fault.after_s > 0:
        time.sleep(fault.after_s)
    if fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.action == "hang":
        _hang_forever()
    else:
        raise RuntimeError(f"fault injected into {name} (rayrl.testing.faults)")


def _hang_forever() -> None:
    while True:  # the watchdog reports this frame, then the worker is killed
        time.sleep(3600)


def inject(group: WorkerGroup, fault: Fault) -> None:
    """Arm `fault` in the workers of `group` (a WorkerGroup) now running; one with
    `times=None` in every worker that replaces one, too."""
    group.add_call_hook(FaultHook(fault), new_workers=fault.times is None)
