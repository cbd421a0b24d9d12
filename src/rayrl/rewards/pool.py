"""RewardPool: rule-based reward functions in worker processes, with a per-call timeout.

A reward function that raises, returns garbage, hangs or crashes its process must cost
one sample's reward, never the run. `concurrent.futures.ProcessPoolExecutor` cannot
stop a task that hangs (cancel() only works before it starts, and killing one of its
processes breaks the whole pool), so the pool owns its processes: each worker is a
spawned process fed samples over a pipe, a few queued behind the one it scores
(`AHEAD_SAMPLES`) so it never waits for the pool between two, and answering each in
order. A call that outlives `timeout_s` (from when the pool saw the answer before
it) has its process (and the process group it leads, so anything it started) killed
and replaced; the sample gets score 0.0 and an error, and the samples queued behind
it go to the next free worker.

Processes are spawned, so the function travels as a picklable spec (see
`loader.resolve_function`): None for the built-in registry, a registered data_source
name, or a `(path, name)` pair of a user file. The spec is resolved once in the caller
too, so a bad file fails at construction with a clear error. With `batched=True` (verl's
batch reward manager) the function takes the lists of a whole `score` call at once, in
one worker, within `timeout_s` per sample; a failed call fails each of its samples.
As with any spawned
process, a script that makes a pool needs an `if __name__ == "__main__":` guard, and a
scorer added with `register_scorer` reaches the workers only if the module registering
it is imported by the reward function's module.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from multiprocessing import get_context, util
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import ForkingPickler
from typing import Any, cast

from rayrl.rewards.loader import BATCH_PARAMS, PARAMS, FunctionSpec, resolve_function
from rayrl.rewards.result import RewardResult, failed, to_result


class RewardPoolError(RuntimeError):
    """The pool cannot score at all (a worker failed to start); not a per-sample failure."""


# Samples sent to a worker ahead of the one it is scoring, so it goes from one to the
# next without waiting for the pool: at most this many, of at most this many bytes in
# all (a socket's buffer holds them; a send never blocks the loop that enforces the
# timeouts). Each sample's timeout starts when the worker starts it.
AHEAD_SAMPLES = 8
AHEAD_BYTES = 32 * 1024


@dataclass
class _Worker:
    process: BaseProcess
    conn: Connection
    since: float  # spawn time until ready, then when the sample it is scoring started
    ready: bool = False
    queue: deque[int] = field(default_factory=deque)  # samples sent, in order; the first is scoring
    sizes: deque[int] = field(default_factory=deque)  # their pickled bytes

    @property
    def index(self) -> int | None:
        """The sample being scored, if any."""
        return self.queue[0] if self.queue else None

    @property
    def queued_bytes(self) -> int:
        """Bytes of the samples waiting behind the one being scored."""
        return sum(self.sizes) - (self.sizes[0] if self.sizes else 0)


class RewardPool:
    """Score samples with a reward function in `num_workers` spawned processes.

    `score(items)` returns one RewardResult per item, in order. Counters: `calls`
    (samples scored), `errors` (calls that failed for any reason, timeouts included),
    `timeouts`, `restarts` (processes replaced). Use as a context manager or call
    `close()`. One `score` call at a time (not thread-safe).
    """

    def __init__(
        self,
        fn_spec: FunctionSpec = None,
        num_workers: int = 2,
        timeout_s: float = 10.0,
        start_timeout_s: float = 120.0,
        batched: bool = False,
    ) -> None:
        if num_workers < 1 or timeout_s <= 0:
            raise ValueError(
                f"RewardPool needs num_workers >= 1 and timeout_s > 0; got "
                f"num_workers={num_workers}, timeout_s={timeout_s} (reward.num_workers, "
                "reward.timeout_s)."
            )
        resolve_function(fn_spec, batched)  # raise here, in the caller, if the spec is bad
        self.fn_spec, self.timeout_s, self.start_timeout_s = fn_spec, timeout_s, start_timeout_s
        self.batched = batched
        self._call_timeout_s = timeout_s
        self.calls = self.errors = self.timeouts = self.restarts = 0
        self._ctx = get_context("spawn")
        self._workers = [self._spawn() for _ in range(num_workers)]
        self._closed = False
        # multiprocessing joins its children at exit: stop ours before that (as its Pool does)
        self._finalizer = util.Finalize(self, _stop_all, args=(self._workers,), exitpriority=10)

    @property
    def pids(self) -> list[int | None]:
        """Process ids of the current workers."""
        return [w.process.pid for w in self._workers]

    def stats(self) -> dict[str, int]:
        """The counters, as a dict."""
        names = ("calls", "errors", "timeouts", "restarts")
        return {name: getattr(self, name) for name in names}

    def score(self, items: list[dict[str, Any]]) -> list[RewardResult]:
        """Score `items` (dicts with data_source, solution_str, ground_truth, extra_info)."""
        if self._closed:
            raise RewardPoolError("RewardPool.score called after close(); make a new pool.")
        for i, item in enumerate(items):
            missing = [k for k in PARAMS[:3] if k not in item]
            if missing:
                raise ValueError(
                    f"RewardPool.score: item {i} lacks {missing}; keys: {sorted(item)}"
                )
        calls = [{k: item.get(k) for k in PARAMS} for item in items]
        if self.batched:
            results = self._batch_results(items, calls)
        else:
            results = self._run(calls, self.timeout_s)
        self.calls += len(items)
        self.errors += sum(r.error is not None for r in results)
        return results

    def _batch_results(
        self, items: list[dict[str, Any]], calls: list[dict[str, Any]]
    ) -> list[RewardResult]:
        """One call with the lists of every item; its failure fails each item."""
        if not items:
            return []
        batch = {
            plural: [c[k] for c in calls] for k, plural in zip(PARAMS, BATCH_PARAMS, strict=True)
        }
        (out,) = self._run([batch], self.timeout_s * len(items))
        if isinstance(out, RewardResult):  # the call failed as a whole
            return [replace(out) for _ in items]
        return cast("list[RewardResult]", out)

    def _run(self, calls: list[dict[str, Any]], timeout_s: float) -> list[Any]:
        """Each call's answer (a RewardResult, or the list a batched call returns), the
        calls spread over the workers, each bounded by `timeout_s`."""
        self._call_timeout_s = timeout_s
        results: list[Any] = [None] * len(calls)
        pending = deque(range(len(calls)))
        try:
            while pending or any(w.index is not None for w in self._workers):
                self._fill(pending, calls, results)
                ready = wait([w.conn for w in self._workers], timeout=self._wait_s())
                for slot, worker in enumerate(self._workers):
                    if worker.conn in ready:
                        self._receive(slot, worker, results, pending)
                self._expire(results, pending)
        finally:  # interrupted (e.g. KeyboardInterrupt): drop calls still in flight
            for slot, worker in enumerate(self._workers):
                if worker.index is not None and not self._closed:
                    self._replace(slot)
        return results

    def close(self) -> None:
        """Stop the worker processes (idempotent)."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spawn(self) -> _Worker:
        parent, child = self._ctx.Pipe()
        process = self._ctx.Process(
            target=_worker_main,
            args=(self.fn_spec, child, os.getpid(), self.batched),
            name="rayrl-reward",
        )
        process.start()
        child.close()
        return _Worker(process, parent, since=time.monotonic())

    def _replace(self, slot: int) -> None:
        _kill(self._workers[slot])
        self._workers[slot] = self._spawn()
        self.restarts += 1

    def _fill(self, pending: deque[Any], calls: list[dict[str, Any]], results: list[Any]) -> None:
        """Send pending samples to the ready workers: one to each idle worker, then up to
        `AHEAD_SAMPLES` behind the one a worker is scoring (`AHEAD_BYTES`), fewer near
        the end so that no sample waits behind a slow one while a worker is idle."""
        ready = [w for w in self._workers if w.ready]
        while pending and ready:
            share = -(-len(pending) // len(ready))
            progressed = False
            for worker in ready:
                if not pending:
                    break
                ahead = len(worker.queue) - 1
                if worker.queue and ahead >= min(AHEAD_SAMPLES, share):
                    continue
                progressed |= self._dispatch(worker, pending, calls, results)
            if not progressed:
                return

    def _dispatch(
        self, worker: _Worker, pending: deque[Any], calls: list[dict[str, Any]], results: list[Any]
    ) -> bool:
        """Send the next pending sample to ``worker`` if its queue has room; whether one
        left ``pending`` (sent, or failed because it could not be pickled)."""
        index = pending[0]
        try:
            payload = bytes(ForkingPickler.dumps((index, calls[index])))
        except Exception as exc:  # e.g. an extra_info value that cannot be pickled
            pending.popleft()
            results[index] = failed(f"sample could not be sent to a reward worker: {exc!r}")
            return True
        if worker.queue and worker.queued_bytes + len(payload) > AHEAD_BYTES:
            return False
        try:
            worker.conn.send_bytes(payload)  # what Connection.send writes; recv() reads it
        except OSError:  # the worker is gone: its end of the pipe reads EOF (`_receive`)
            return False
        pending.popleft()
        if not worker.queue:
            worker.since = time.monotonic()
        worker.queue.append(index)
        worker.sizes.append(len(payload))
        return True

    def _requeue(self, worker: _Worker, pending: deque[Any]) -> None:
        """The samples queued behind the first (never started) go back to the front."""
        for index in reversed(list(worker.queue)[1:]):
            pending.appendleft(index)
        worker.queue.clear()
        worker.sizes.clear()

    def _wait_s(self) -> float:
        """Seconds until the next call or start-up deadline (1 s when none is pending)."""
        deadlines = []
        for w in self._workers:
            if w.index is not None:
                deadlines.append(w.since + self._call_timeout_s)
            elif not w.ready:
                deadlines.append(w.since + self.start_timeout_s)
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else 1.0

    def _receive(self, slot: int, worker: _Worker, results: list[Any], pending: deque[Any]) -> None:
        """Every message the worker has sent (one result per sample, in order)."""
        while self._receive_one(slot, worker, results, pending) and worker.conn.poll():
            pass

    def _receive_one(
        self, slot: int, worker: _Worker, results: list[Any], pending: deque[Any]
    ) -> bool:
        """One message; False when the worker died (and was replaced)."""
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            worker.process.join(timeout=5)
            code = worker.process.exitcode
            if not worker.ready:
                self.close()
                raise RewardPoolError(
                    f"a reward worker process exited (code {code}) before it was ready "
                    f"(loading {self.fn_spec!r}); its traceback is on stderr. A script that "
                    "makes a pool needs an `if __name__ == '__main__':` guard, since spawned "
                    "processes import it again."
                ) from None
            if worker.index is not None:
                elapsed = time.monotonic() - worker.since
                results[worker.index] = failed(
                    f"reward worker process died (exit code {code}) while scoring", elapsed
                )
            self._requeue(worker, pending)
            self._replace(slot)
            return False
        kind, payload = message
        if kind == "load_error":
            self.close()
            raise RewardPoolError(f"a reward worker could not load {self.fn_spec!r}: {payload}")
        if kind == "ready":
            worker.ready = True
            return True
        now = time.monotonic()
        for result in payload if isinstance(payload, list) else [payload]:
            result.elapsed_s = now - worker.since
        results[worker.queue.popleft()] = payload
        worker.sizes.popleft()
        worker.since = now  # the worker starts the next one, if any, now
        return True

    def _expire(self, results: list[Any], pending: deque[Any]) -> None:
        now = time.monotonic()
        for slot, worker in enumerate(self._workers):
            if worker.index is not None and now - worker.since >= self._call_timeout_s:
                results[worker.index] = failed(
                    f"timed out after {self._call_timeout_s:g} s", now - worker.since
                )
                self.timeouts += 1
                self._requeue(worker, pending)
                self._replace(slot)
            elif not worker.ready and now - worker.since >= self.start_timeout_s:
                self.close()
                raise RewardPoolError(
                    f"a reward worker did not start within {self.start_timeout_s:g} s "
                    f"(loading {self.fn_spec!r}); is the machine overloaded or the "
                    "reward file slow to import? Raise start_timeout_s."
                )


def _worker_main(spec: FunctionSpec, conn: Connection, parent_pid: int, batched: bool) -> None:
    """Worker process: load the function, then score samples (or batches) until told to stop."""
    if hasattr(os, "setpgrp"):
        os.setpgrp()  # lead a process group, so a kill also reaches what the function started
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    try:
        fn = resolve_function(spec, batched)
    except BaseException as exc:
        conn.send(("load_error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        _, kwargs = message
        try:
            out = _awaited(fn(**kwargs))
            result = _batch_to_results(out, kwargs) if batched else to_result(out)
        except BaseException as exc:
            result = failed(f"{type(exc).__name__}: {exc}")
        try:
            conn.send(("result", result))
        except Exception as exc:  # e.g. an extra metric that cannot be pickled
            conn.send(("result", failed(f"result could not be sent back: {exc!r}")))


def _awaited(out: Any) -> Any:
    """A function's return, awaited when it is a coroutine (an ``async def``
    compute_score, as verl's generative reward models write theirs)."""
    if inspect.isawaitable(out):
        return asyncio.run(_wait_for(out))
    return out


async def _wait_for(awaitable: Any) -> Any:
    return await awaitable


def _batch_to_results(out: Any, kwargs: dict[str, list[Any]]) -> list[RewardResult] | RewardResult:
    """A batched function's answer: one score (number or dict) per sample, in order."""
    n = len(kwargs[BATCH_PARAMS[0]])
    if hasattr(out, "tolist"):  # a numpy array or a tensor of scores
        out = out.tolist()
    if not isinstance(out, list | tuple) or len(out) != n:
        got = f"{len(out)} values" if isinstance(out, list | tuple) else type(out).__name__
        return failed(f"a batched reward function must return a list of {n} scores; got {got}")
    return [to_result(value) for value in out]


def _exit_with_parent(parent_pid: int) -> None:
    """Exit when the parent is gone, so an orphaned worker never lingers."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)


def _kill(worker: _Worker) -> None:
    pid = worker.process.pid
    try:
        if hasattr(os, "killpg") and pid is not None:
            os.killpg(pid, signal.SIGKILL)
        else:
            worker.process.kill()
    except OSError:  # not (yet) a group leader, or already gone
        worker.process.kill()
    worker.process.join(timeout=5)
    worker.conn.close()


def _stop_all(workers: list[_Worker]) -> None:
    """Ask every worker to stop, then kill whatever is still running."""
    for worker in workers:
        with contextlib.suppress(OSError):
            worker.conn.send(None)
    deadline = time.monotonic() + 1.0
    for worker in workers:
        worker.process.join(timeout=max(0.0, deadline - time.monotonic()))
        if worker.process.is_alive():
            _kill(worker)
        else:
            worker.conn.close()
