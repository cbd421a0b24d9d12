"""Ctrl-C and SIGTERM during training: the first stops at a safe point with a checkpoint,
the second stops now.

While `fit` runs, `StopOnInterrupt` owns SIGINT and SIGTERM (in the main thread;
elsewhere it does nothing). SIGTERM is how Slurm, Kubernetes and `kill` stop a job:
it gets the same grace as a first Ctrl-C. The first signal only sets a flag and says
so: the step ends at its next worker call (its state restored to the step's start from
the snapshot, or, with no snapshot once an update ran, after the step's last call), a
checkpoint is written and the run tears down. A second SIGINT raises KeyboardInterrupt
at once, a second SIGTERM `SystemExit(143)`, so the caller's teardown runs (`rayrl
train` kills the workers and releases the pools). The handlers that were there before
are put back when `fit` ends; they are never called from ours, so no chain of handlers
can recurse.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)
NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}


class StopRequested(Exception):  # noqa: N818 - a request, not an error
    """The user asked the run to stop (a first Ctrl-C or SIGTERM); raised at a safe point."""


class StopOnInterrupt:
    """SIGINT and SIGTERM handling for one `fit` (see the module docstring)."""

    def __init__(self, print_fn: Callable[[str], None] = print) -> None:
        self.print = print_fn
        self.signal: int | None = None  # the signal that asked for the stop
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signal is not None

    @property
    def exit_code(self) -> int:
        """The shell's code for a process ended by the signal that stopped the run."""
        return 128 + int(self.signal or signal.SIGINT)

    def __enter__(self) -> StopOnInterrupt:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.getsignal(sig)
                signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def _handle(self, signum: int, frame: Any) -> None:
        sig = signal.Signals(signum)
        name = NAMES.get(sig, sig.name)
        if not self.requested:
            self.signal = signum
            self.print(
                f"{name}: stopping at the next safe point, then writing a checkpoint "
                f"({name} again to stop at once, without one)"
            )
            return
        self.__exit__()
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    def check(self, mutated: bool = False, can_undo: bool = True) -> None:
        """Raise StopRequested once asked, unless the step changed state that cannot be
        undone (an update ran and no snapshot holds the step's start)."""
        if self.requested and (can_undo or not mutated):
            raise StopRequested
