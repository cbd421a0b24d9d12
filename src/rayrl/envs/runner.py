"""Running tool calls concurrently, each under a timeout, never raising into the caller.

`ToolRunner.submit(fn, timeout_s)` starts ``fn`` on a daemon thread and returns a
future that always resolves to a `CallOutcome`: the value, or the exception ``fn``
raised, or a timeout. At most ``max_concurrency`` calls execute at once; the others
wait their turn, and the timeout counts from the moment a call starts executing.

A thread cannot be killed: a call that overruns its timeout is *abandoned*. Its
future resolves as timed out at once, its concurrency slot is handed back (so a
hung tool cannot starve the others), and the thread runs on in the background until
the function returns; `abandoned` counts them. Tools that may hang for good should
run their work in a child process they can kill (as the code tool does, through
`rayrl.envs.sandbox`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

__all__ = ["CallOutcome", "ToolRunner"]


@dataclass
class CallOutcome:
    """How one call ended: ``value`` if it returned, else ``error`` or ``timed_out``."""

    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False
    latency_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None and not self.timed_out


class ToolRunner:
    """Concurrent calls with per-call timeouts (see the module docstring).

    Args:
        max_concurrency: calls executing at once at most.
        default_timeout_s: the timeout of a call submitted with ``timeout_s=None``.
    """

    def __init__(self, max_concurrency: int = 16, default_timeout_s: float = 30.0) -> None:
        if max_concurrency < 1:
            raise ValueError(f"ToolRunner: max_concurrency={max_concurrency} must be >= 1.")
        if default_timeout_s <= 0:
            raise ValueError(f"ToolRunner: default_timeout_s={default_timeout_s} must be > 0.")
        self.max_concurrency = max_concurrency
        self.default_timeout_s = float(default_timeout_s)
        self._slots = threading.Semaphore(max_concurrency)
        self._lock = threading.Lock()
        self.abandoned = 0  # calls that timed out and whose threads may still run
        self.running = 0

    def submit(
        self, fn: Callable[[], Any], timeout_s: float | None = None, name: str = "tool"
    ) -> Future:
        """Start ``fn()``; the future resolves to a `CallOutcome`, never to an exception."""
        future: Future = Future()
        timeout = self.default_timeout_s if timeout_s is None else float(timeout_s)
        thread = threading.Thread(
            target=self._run, args=(fn, timeout, future), name=f"rayrl-tool-{name}", daemon=True
        )
        thread.start()
        return future

    def call(self, fn: Callable[[], Any], timeout_s: float | None = None) -> CallOutcome:
        """`submit` and wait for the outcome."""
        return self.submit(fn, timeout_s).result()

    def _run(self, fn: Callable[[], Any], timeout: float, future: Future) -> None:
        self._slots.acquire()
        slot = _Slot(self._slots)
        start = time.perf_counter()
        with self._lock:
            self.running += 1
        timer = threading.Timer(timeout, self._expire, args=(future, slot, start))
        timer.daemon = True
        timer.start()
        try:
            outcome = CallOutcome(value=fn())
        except BaseException as err:  # a tool may raise anything, SystemExit included
            outcome = CallOutcome(error=err)
        finally:
            timer.cancel()
            with self._lock:
                self.running -= 1
            slot.release()
        outcome.latency_s = time.perf_counter() - start
        _resolve(future, outcome)

    def _expire(self, future: Future, slot: _Slot, start: float) -> None:
        latency = time.perf_counter() - start
        if _resolve(future, CallOutcome(timed_out=True, latency_s=latency)):
            with self._lock:
                self.abandoned += 1
            slot.release()


class _Slot:
    """A concurrency slot released at most once (by the call's end or its timeout)."""

    def __init__(self, semaphore: threading.Semaphore) -> None:
        self._semaphore, self._lock, self._held = semaphore, threading.Lock(), True

    def release(self) -> None:
        with self._lock:
            if not self._held:
                return
            self._held = False
        self._semaphore.release()


def _resolve(future: Future, outcome: CallOutcome) -> bool:
    """Set the future's result unless it already has one; True if this call set it."""
    try:
        future.set_result(outcome)
    except Exception:  # InvalidStateError: the other side (end or timeout) won
        return False
    return True
