"""Running tool calls concurrently, each under a timeout, never raising into the caller.

`ToolRunner.submit(fn, timeout_s)` queues ``fn`` and returns a future that always
resolves to a `CallOutcome`: the value, or the exception ``fn`` raised, or a timeout.
Calls run on the runner's worker threads, at most ``max_concurrency`` at once (the
others wait their turn), and the timeout counts from the moment a call starts
executing. Workers are started as calls need them and kept while calls keep coming
(an idle one ends after `IDLE_S`); one watchdog thread expires the calls past their
timeouts. A rollout makes thousands of calls: no call starts a thread of its own.

A thread cannot be killed: a call that overruns its timeout is *abandoned*. Its
future resolves as timed out at once, its concurrency slot is handed back (a new
worker takes it, so a hung tool cannot starve the others), and its worker runs on in
the background until the function returns, then ends; `abandoned` counts them. Tools
that may hang for good should run their work in a child process they can kill (as
the code tool does, through `rayrl.envs.sandbox`).
"""

from __future__ import annotations

import heapq
import itertools
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

__all__ = ["CallOutcome", "ToolRunner"]

IDLE_S = 2.0  # an idle worker (or watchdog) thread ends after this many seconds


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
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._workers = 0  # worker threads that hold a slot (abandoned ones do not)
        self._idle = 0  # of those, the ones waiting for a call
        self._queued = 0  # calls submitted and not taken by a worker yet
        self._watchdog = _Watchdog(self._expire)
        self.abandoned = 0  # calls that timed out and whose threads may still run
        self.running = 0

    def submit(
        self, fn: Callable[[], Any], timeout_s: float | None = None, name: str = "tool"
    ) -> Future:
        """Start ``fn()``; the future resolves to a `CallOutcome`, never to an exception."""
        future: Future = Future()
        timeout = self.default_timeout_s if timeout_s is None else float(timeout_s)
        self._calls.put((fn, timeout, future, name))
        with self._lock:
            self._queued += 1
            spawn = self._claim_worker()
        if spawn:
            self._start_worker()
        return future

    def _claim_worker(self) -> bool:
        """Under the lock: whether a queued call needs a new worker (a slot is free and no
        idle worker takes it); if so, count it as started (idle)."""
        spawn = self._queued > self._idle and self._workers < self.max_concurrency
        if spawn:
            self._workers += 1
            self._idle += 1
        return spawn

    def _start_worker(self) -> None:
        threading.Thread(target=self._work, name="rayrl-tool-worker", daemon=True).start()

    def call(self, fn: Callable[[], Any], timeout_s: float | None = None) -> CallOutcome:
        """`submit` and wait for the outcome."""
        return self.submit(fn, timeout_s).result()

    def _work(self) -> None:
        """A worker: runs queued calls until idle for `IDLE_S` or abandoned."""
        while True:
            try:
                fn, timeout, future, name = self._calls.get(timeout=IDLE_S)
            except queue.Empty:
                with self._lock:
                    if self._queued < self._idle:  # the other idle workers take them
                        self._workers -= 1
                        self._idle -= 1
                        return
                continue
            with self._lock:
                self._queued -= 1
                self._idle -= 1
                self.running += 1
            threading.current_thread().name = f"rayrl-tool-{name}"
            in_time = self._run(fn, timeout, future)
            del fn, future  # an idle worker holds on to no call's result
            if not in_time:
                return  # abandoned: its slot went to another worker
            with self._lock:
                self._idle += 1

    def _run(self, fn: Callable[[], Any], timeout: float, future: Future) -> bool:
        """Run one call; False if it was abandoned (timed out) meanwhile."""
        start = time.perf_counter()
        entry = self._watchdog.add(start + timeout, future, start)
        try:
            outcome = CallOutcome(value=fn())
        except BaseException as err:  # a tool may raise anything, SystemExit included
            outcome = CallOutcome(error=err)
        finally:
            entry.cancel()
            with self._lock:
                self.running -= 1
        outcome.latency_s = time.perf_counter() - start
        return _resolve(future, outcome)

    def _expire(self, future: Future, start: float) -> None:
        latency = time.perf_counter() - start
        if not _resolve(future, CallOutcome(timed_out=True, latency_s=latency)):
            return
        with self._lock:
            self.abandoned += 1
            self._workers -= 1  # its worker runs on without a slot; another may start
            spawn = self._claim_worker()
        if spawn:
            self._start_worker()


@dataclass(order=True)
class _Deadline:
    at: float
    seq: int
    future: Future | None = None
    start: float = 0.0
    cancelled: bool = False

    def cancel(self) -> None:
        """The call ended in time. The entry stays in the heap until its deadline comes
        round (minutes, for an environment step), so it lets go of the future, and
        with it the call's result, now."""
        self.cancelled = True
        self.future = None


class _Watchdog:
    """One thread that expires calls at their deadlines (started when a call runs,
    ended after `IDLE_S` with none to watch)."""

    def __init__(self, expire: Callable[[Future, float], None]) -> None:
        self._expire = expire
        self._heap: list[_Deadline] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._alive = False

    def add(self, at: float, future: Future, start: float) -> _Deadline:
        entry = _Deadline(at, next(self._seq), future, start)
        with self._cond:
            heapq.heappush(self._heap, entry)
            if not self._alive:
                self._alive = True
                threading.Thread(target=self._loop, name="rayrl-tool-watchdog", daemon=True).start()
            elif self._heap[0] is entry:
                self._cond.notify()
        return entry

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._heap and self._heap[0].cancelled:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait(IDLE_S)
                    if not self._heap:
                        self._alive = False
                        return
                    continue
                wait = self._heap[0].at - time.perf_counter()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                due = heapq.heappop(self._heap)
                future = due.future  # None once the call has ended
            if future is not None and not due.cancelled:
                self._expire(future, due.start)


def _resolve(future: Future, outcome: CallOutcome) -> bool:
    """Set the future's result unless it already has one; True if this call set it."""
    try:
        future.set_result(outcome)
    except Exception:  # InvalidStateError: the other side (end or timeout) won
        return False
    return True
