"""Ctrl-C during training: the first stops at a safe point, the second stops now.

While `fit` runs, `StopOnInterrupt` owns SIGINT (in the main thread; elsewhere it
does nothing). The first SIGINT only sets a flag and says so: the step ends at its
next worker call (its state restored to the step's start from the snapshot, or, with
no snapshot once an update ran, after the step's last call), a checkpoint is written
and the run tears down. A second SIGINT raises KeyboardInterrupt at once, so the
caller's teardown runs (`rayrl train` kills the workers and releases the pools). The
handler that was there before is put back when `fit` ends; it is never called from
ours, so no chain of handlers can recurse.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any


class StopRequested(Exception):  # noqa: N818 - a request, not an error
    """The user asked the run to stop (first Ctrl-C); raised at a safe point."""


class StopOnInterrupt:
    """SIGINT handling for one `fit` (see the module docstring)."""

    def __init__(self, print_fn: Callable[[str], None] = print) -> None:
        self.print = print_fn
        self.requested = False
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> StopOnInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.getsignal(signal.SIGINT)
            signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            previous = self._previous if self._previous is not None else signal.SIG_DFL
            signal.signal(signal.SIGINT, previous)
            self._installed = False

    def _handle(self, signum: int, frame: Any) -> None:
        if not self.requested:
            self.requested = True
            self.print(
                "Ctrl-C: stopping at the next safe point, then writing a checkpoint "
                "(Ctrl-C again to stop at once, without one)"
            )
            return
        self.__exit__()
        raise KeyboardInterrupt

    def check(self, mutated: bool = False, can_undo: bool = True) -> None:
        """Raise StopRequested once asked, unless the step changed state that cannot be
        undone (an update ran and no snapshot holds the step's start)."""
        if self.requested and (can_undo or not mutated):
            raise StopRequested
