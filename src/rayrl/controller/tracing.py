"""torch.profiler traces of chosen calls, taken inside the worker processes.

The driver arms a window in each worker (`Worker._rayrl_trace(window)`) and disarms it
later (`_rayrl_trace(None)`); while armed, each call the window names runs under
torch.profiler on the call's own thread (the profiler records the thread that starts
it), on the ranks the window names, and its Chrome trace is written into the window's
directory as ``{label}_rank{rank}.{call}.json.gz`` (a second call of the same name
adds ``-2``, ...). At disarm, a label that is not `discrete` has its calls' traces
joined into one ``{label}_rank{rank}.json.gz``, its events on one clock (torch's
``baseTimeNanoseconds`` + ``ts`` is the wall clock in microseconds).

A call that starts while another call of the same process is being traced (replica
calls run side by side) runs untraced: torch.profiler has one session per process.
The hook is installed in a process by its first window (`rayrl.controller.calls`).
"""

from __future__ import annotations

import gzip
import json
import os
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

__all__ = ["TraceTarget", "TraceWindow", "arm", "disarm", "join_traces"]


@dataclass(frozen=True)
class TraceTarget:
    """How the calls of one name are traced: filed under `label` (a role), on `ranks`
    (None: every rank), recording `contents` (cpu, cuda, memory, shapes, stack; none
    given: cpu, and cuda where a GPU is visible)."""

    label: str
    ranks: tuple[int, ...] | None = (0,)
    contents: tuple[str, ...] = ()
    discrete: bool = False


@dataclass(frozen=True)
class TraceWindow:
    """The calls to trace (by method name) while armed, and where the traces go."""

    directory: str
    targets: dict[str, TraceTarget]


_LOCK = threading.Lock()
_ARMED: TraceWindow | None = None
_WRITTEN: list[tuple[TraceTarget, int, Path]] = []
_TRACING = threading.Lock()  # held while a call is traced: one session per process


def arm(window: TraceWindow) -> None:
    """Trace the calls `window` names from now on (in this process)."""
    global _ARMED
    from rayrl.controller import calls

    calls.add_call_hooks([_hook])
    with _LOCK:
        _ARMED = window
        _WRITTEN.clear()


def disarm() -> list[str]:
    """Stop tracing; join the traces of each label that is not discrete; the files."""
    global _ARMED
    with _LOCK:
        _ARMED = None
        written, _WRITTEN[:] = list(_WRITTEN), []
    out: list[str] = []
    by_file: dict[tuple[str, int, Path], list[Path]] = {}
    for target, rank, path in written:
        if target.discrete:
            out.append(str(path))
        else:
            by_file.setdefault((target.label, rank, path.parent), []).append(path)
    for (label, rank, directory), parts in by_file.items():
        joined = directory / f"{label}_rank{rank}.json.gz"
        join_traces(parts, joined)
        out.append(str(joined))
    return sorted(out)


def _hook(worker: Any, name: str) -> AbstractContextManager[None] | None:
    """The call hook: a traced call's profiler session, or None."""
    window = _ARMED
    target = window.targets.get(name) if window is not None else None
    rank = getattr(worker, "rank", 0)
    if target is None or (target.ranks is not None and rank not in target.ranks):
        return None
    assert window is not None
    return _traced(window, target, rank, name)


@contextmanager
def _traced(window: TraceWindow, target: TraceTarget, rank: int, name: str) -> Iterator[None]:
    if not _TRACING.acquire(blocking=False):  # another call of this process is traced
        yield
        return
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile

        contents = set(target.contents)
        cuda = torch.cuda.is_available()
        activities = []
        if not contents & {"cpu", "cuda"} or "cpu" in contents:
            activities.append(ProfilerActivity.CPU)
        if cuda and (not contents & {"cpu", "cuda"} or "cuda" in contents):
            activities.append(ProfilerActivity.CUDA)
        with profile(
            activities=activities,
            record_shapes="shapes" in contents,
            profile_memory="memory" in contents,
            with_stack="stack" in contents,
        ) as prof:
            yield
        path = _free_path(Path(window.directory), f"{target.label}_rank{rank}.{name}")
        prof.export_chrome_trace(str(path))
        with _LOCK:
            _WRITTEN.append((target, rank, path))
    finally:
        _TRACING.release()


def _free_path(directory: Path, stem: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path, n = directory / f"{stem}.json.gz", 1
    while path.exists():
        n += 1
        path = directory / f"{stem}-{n}.json.gz"
    return path


def join_traces(parts: list[Path], out: Path) -> None:
    """One Chrome trace of `parts` (torch.profiler traces of one process), their events
    moved to the first part's clock; the parts are removed."""
    if len(parts) == 1:
        os.replace(parts[0], out)
        return
    traces = [_read(p) for p in parts]
    base = traces[0].get("baseTimeNanoseconds", 0)
    events = []
    for trace in traces:
        shift_us = (trace.get("baseTimeNanoseconds", 0) - base) / 1000
        for event in trace.get("traceEvents", []):
            if event.get("ph") != "M" and isinstance(event.get("ts"), int | float):
                event = {**event, "ts": event["ts"] + shift_us}
            events.append(event)
    joined = {**traces[0], "traceEvents": events}
    tmp = out.with_name(out.name + ".tmp")
    with gzip.open(tmp, "wt") as f:
        json.dump(joined, f)
    os.replace(tmp, out)
    for part in parts:
        part.unlink()


def _read(path: Path) -> dict[str, Any]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return cast("dict[str, Any]", json.load(f))
