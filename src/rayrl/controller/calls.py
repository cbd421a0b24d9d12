"""Calls entering a worker: what runs around each one inside the worker's process.

Every call a group makes on a worker (a registered method, and the group's own calls:
`init_worker`, `init_distributed`, `rebuild`, `snapshot`, `restore`) runs inside
`running(worker, name)` (a snapshot's hand-over, beside the next calls, only inside
its hooks: `hooked(worker, "snapshot_publish")`), which

- marks the worker busy in `name` on this thread (`_rayrl_busy`: `Worker.heartbeat`,
  the watchdog's stack capture and the usage sampler read it; with calls running
  side by side, as a rollout replica's do, the oldest of them) and restarts the
  progress clock (`rayrl.progress`, which the watchdog measures);
- for a registered method, records when it ran (`usage.record_call`: the driver's
  overhead is the time between calls) and takes a usage sample as it ends, so a stage
  shorter than the sampling period is measured too;
- runs the call hooks installed in this process;
- for a registered method, fetches the rows its Batch arguments hold remotely and,
  for a call made with `GroupMethod.keeping()`, keeps its result's wide columns in
  this worker (`rayrl.controller.kept`);
- when the call fails because a gloo collective lost a peer, leaves the process group
  (`rayrl.controller.collective_failure`), so the ranks waiting on this one fail too
  instead of blocking until the group's timeout.

`Worker.__init_subclass__` wraps each registered method of a class once (`track`),
so `@register` itself only states the method's contract. Coroutine methods run on an
event loop and are left as they are.

Call hooks are an extension point: a hook is a picklable callable
`hook(worker, name)` that runs at the start of each call, on the call's thread, after
the worker is marked busy (a hook that blocks is seen by the watchdog like the call
it delays). It returns None, or a context manager that is entered then and exited
when the call ends. `worker` is the instance the call runs on (in a fused worker, the
role's instance for a registered method, the fused worker for the group's own
calls). Install hooks in a group's workers with `WorkerGroup.add_call_hook`::

    class Profile:                      # profile one method on rank 0
        def __call__(self, worker, name):
            if name == "update_actor" and worker.rank == 0:
                return torch.profiler.profile(...)

    group.add_call_hook(Profile())      # every worker now, and every one started later

Uses: tracing or profiling chosen calls, logging, stopping one rank in the debugger
at a given call, injecting faults in tests (`rayrl.testing.faults`). Each process
holds its own copy of a hook, so a hook may keep per-process state.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

from rayrl import progress
from rayrl.controller import usage
from rayrl.controller.collective_failure import release_after_collective_failure
from rayrl.controller.dispatch import method_specs
from rayrl.controller.kept import KEEP_KWARG, keep_wide_columns, resolve_arguments

CallHook = Callable[[Any, str], "AbstractContextManager[Any] | None"]

TRACKED_ATTR = "__rayrl_tracked__"

# The call hooks installed in this process, in the order they run.
_HOOKS: list[CallHook] = []
_HOOKS_LOCK = threading.Lock()


@contextmanager
def running(worker: Any, name: str, *, record: bool = False) -> Iterator[None]:
    """Run the block as call `name` of `worker` (see the module docstring); `record`:
    a registered method's call, recorded for the usage report."""
    progress.begin()
    start = time.time()
    active = worker.__dict__.setdefault("_rayrl_active", {})  # concurrent calls (replicas)
    key = object()
    active[key] = (name, start, threading.get_ident())
    worker._rayrl_busy = min(active.values(), key=lambda call: call[1])  # the oldest call
    try:
        with hooked(worker, name):
            yield
    except Exception as err:
        rank = getattr(worker, "rank", "?")
        release_after_collective_failure(err, f"rank {rank} in {name}")
        raise
    finally:
        if record:
            usage.record_call(start, time.time())
            usage.sample_now()
        active.pop(key, None)
        worker._rayrl_busy = min(active.values(), key=lambda call: call[1]) if active else None


@contextmanager
def hooked(worker: Any, name: str) -> Iterator[None]:
    """Run the block inside the call hooks installed in this process, as call `name`
    (what `running` does around each call; alone, for work that runs beside a call,
    such as a snapshot's hand-over on its own thread: `snapshot_publish`)."""
    with ExitStack() as around:
        for hook in tuple(_HOOKS):
            entered = hook(worker, name)
            if entered is not None:
                around.enter_context(entered)
        yield


def track(cls: type) -> None:
    """Wrap each registered method of `cls` (inherited ones included) that is not
    wrapped yet, so that its calls run inside `running`."""
    for name in method_specs(cls):
        fn = inspect.getattr_static(cls, name)
        if not inspect.isfunction(fn) or getattr(fn, TRACKED_ATTR, False):
            continue
        if inspect.iscoroutinefunction(fn):
            continue
        setattr(cls, name, _tracked(fn))


def _tracked(fn: Callable[..., Any]) -> Callable[..., Any]:
    name = fn.__name__

    @functools.wraps(fn)  # keeps the MethodSpec and any Ray method options
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        keep = kwargs.pop(KEEP_KWARG, False)
        with running(self, name, record=True):
            resolve_arguments(args, kwargs)
            out = fn(self, *args, **kwargs)
            return keep_wide_columns(out, keep) if keep else out

    # Ray checks a call's arguments against the signature of the innermost function
    # (`inspect.unwrap`): this wrapper is that function, and accepts the kept flag too.
    del call.__wrapped__
    # `inspect.signature` reads `__signature__` off any callable; typeshed's wrapper type
    # does not declare it, so mypy cannot follow this assignment
    call.__signature__ = _with_keep_flag(inspect.signature(fn))  # type: ignore[attr-defined]
    setattr(call, TRACKED_ATTR, True)
    return call


def _with_keep_flag(sig: inspect.Signature) -> inspect.Signature:
    """`sig` accepting the keyword a kept call adds (`rayrl.controller.kept`)."""
    params = list(sig.parameters.values())
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return sig
    flag = inspect.Parameter(KEEP_KWARG, inspect.Parameter.KEYWORD_ONLY, default=False)
    return sig.replace(parameters=[*params, flag])


def add_call_hooks(hooks: Iterable[CallHook]) -> int:
    """Install `hooks` in this process (one already installed is not added twice);
    returns how many are installed."""
    with _HOOKS_LOCK:
        for hook in hooks:
            if not any(hook is known for known in _HOOKS):
                _HOOKS.append(hook)
        return len(_HOOKS)
