"""Progress of a process's long call, for its watchdog: what moved last, and when.

Engines call `tick(tokens=...)` from inside long calls (a decode step, a micro-batch,
a weight bucket) and wrap sub-phases in `phase("weight_sync")`; the worker's health
thread reads `state()` to tell a slow call that still moves from one that hangs
(`rayrl.controller.watchdog`). The values are plain module globals written by the
call's thread and read by the health thread: each update is one assignment, atomic
under the GIL, and a reader that sees one a tick late loses nothing. A leaf module:
it imports nothing of rayrl, so any layer may report progress.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

_counts: dict[str, int] = {}
_last = time.monotonic()
_phase: str | None = None


def begin() -> None:
    """A new call starts: counts cleared, the progress clock restarted."""
    global _counts, _last, _phase
    _counts, _last, _phase = {}, time.monotonic(), None


def tick(**counts: int) -> None:
    """Something moved (e.g. `tick(tokens=64)`, `tick(micro_batches=1)`)."""
    global _last
    for name, n in counts.items():
        _counts[name] = _counts.get(name, 0) + int(n)
    _last = time.monotonic()


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Name the sub-phase the call is in while the block runs (it counts as progress)."""
    global _phase
    outer = _phase
    _phase = name
    tick()
    try:
        yield
    finally:
        _phase = outer
        tick()


def state() -> dict:
    """Seconds since anything moved, the counts of this call and its sub-phase."""
    return {"idle_s": time.monotonic() - _last, "counts": dict(_counts), "phase": _phase}
