"""Errors raised by worker groups: which phase failed, on which worker, and where its log is.

Every error a WorkerGroup raises names the phase (create, init, call), the stage (the
method that ran), the role, the rank, the node, the pid and the worker's Ray log file,
and wraps the original remote traceback, so a user can go straight to the right log.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray.exceptions

DEAD_ERRORS = (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError)


@dataclass
class WorkerDescription:
    """What the controller knows about one worker, for error messages and reports."""

    role: str
    rank: int
    node_id: str = "?"
    pid: int | None = None
    log_file: str = ""
    bundle: str = ""
    group: str = ""  # the WorkerGroup's name

    def where(self) -> str:
        """A one-line location: role, rank, node, pid."""
        pid = self.pid if self.pid is not None else "?"
        return f"role '{self.role}' rank {self.rank} (node {self.node_id}, pid {pid})"


def log_tail(path: str, lines: int = 8) -> str:
    """The last lines of a worker log file, if it is readable from this machine."""
    try:
        text = Path(path).read_text(errors="replace").rstrip().splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


class WorkerError(RuntimeError):
    """A worker failed during `phase` ("create", "init" or "call") of `stage`.

    Attributes name the worker (role, rank, node_id, pid, log_file); `cause` is the
    original exception (a Ray error wrapping the remote traceback) and `dead` says
    whether the worker process is gone (then `WorkerGroup.replace(rank)` is the fix).
    """

    phase = "call"

    def __init__(
        self,
        stage: str,
        worker: WorkerDescription,
        cause: BaseException | str,
        hint: str = "",
    ) -> None:
        self.stage = stage
        self.worker = worker
        self.role, self.rank = worker.role, worker.rank
        self.node_id, self.pid, self.log_file = worker.node_id, worker.pid, worker.log_file
        self.cause = cause
        self.dead = isinstance(cause, DEAD_ERRORS)
        super().__init__(self._message(hint))

    hung = False

    def _message(self, hint: str) -> str:
        what = "hung" if self.hung else "died" if self.dead else "failed"
        cause = self.cause
        summary = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        parts = [
            f"{self.phase} of '{self.stage}' {what} on {self.worker.where()}",
            f"  worker log: {self.log_file or '(unknown: the worker never started)'}",
        ]
        if self.worker.bundle:
            parts.append(f"  bundle: {self.worker.bundle}")
        if self.dead:
            hint = hint or f"the worker process is gone; call group.replace({self.rank})"
            tail = log_tail(self.log_file)
            if tail:
                parts.append("  last lines of the worker log:\n    " + tail.replace("\n", "\n    "))
        if hint:
            parts.append(f"  what to do: {hint}")
        parts.append(f"  cause: {summary}")
        return "\n".join(parts)


class WorkerCreateError(WorkerError):
    """A worker actor could not be placed or did not come alive in time."""

    phase = "create"


class WorkerInitError(WorkerError):
    """A worker's `init_worker` (model load, process group) failed or timed out."""

    phase = "init"


class WorkerCallError(WorkerError):
    """A registered method raised on one rank, or that rank's process died."""

    phase = "call"


class WorkerHungError(WorkerCallError):
    """A rank made no progress in its call for longer than the stage deadline
    (`trainer.stage_timeout_s`); `stack` is the Python stack of its busy thread."""

    hung = True

    def __init__(self, stage: str, worker: WorkerDescription, cause: str, stack: str) -> None:
        self.stack = stack
        shown = (
            "\n  stack of the busy thread:\n    " + stack.rstrip().replace("\n", "\n    ")
            if stack
            else "\n  (no Python stack: the process did not answer)"
        )
        super().__init__(
            stage,
            worker,
            cause + shown,
            hint="the run treats the rank as failed: it is killed, replaced and the step "
            "replayed; raise trainer.stage_timeout_s if the call is only slow",
        )


class GroupTimeoutError(TimeoutError):
    """A group call did not finish in time; the message names the ranks still running."""


class NoSpareBundleError(RuntimeError):
    """A worker's node is gone and its pool has no spare bundle to move it to."""


class FutureArgumentError(ValueError):
    """A future passed into a group call could not be made into that call's arguments
    (e.g. ALL_TO_ALL got a value that is not a list with one element per rank)."""


def timeout_text(
    phase: str, stage: str, timeout_s: float, worker: WorkerDescription, state: str
) -> str:
    if phase != "create":
        return f"'{stage}' did not finish within {timeout_s:.0f} s"
    if worker.pid is not None:
        return (
            f"the actor process started (pid {worker.pid}, Ray state {state}) but its "
            f"constructor did not return within {timeout_s:.0f} s"
        )
    return (
        f"Ray did not start the actor within {timeout_s:.0f} s (Ray state {state or '?'}): "
        "its bundle's resources may be held by another actor, or its runtime env is still "
        "being set up"
    )


def failure_hint(phase: str, cause: Any, attempts: int) -> str:
    tried = f"tried {attempts} times; " if attempts > 1 else ""
    if phase == "create":
        return tried + "read the worker log; check the bundle shape fits the node (rayrl plan)"
    if isinstance(cause, DEAD_ERRORS):
        return tried + "the worker process died during init; read the worker log (out of memory?)"
    return (
        tried + "read the traceback and the worker log; raise timeout_s or retries if init is slow"
    )


def short_error(err: Any) -> str:
    """`Type: first line` of `err`; of the worker's own exception for a Ray task error
    (whose first line is only the remote method's name)."""
    cause = getattr(err, "cause", None) if isinstance(err, ray.exceptions.RayTaskError) else None
    if isinstance(cause, BaseException):
        err = cause
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"
