"""Starting several worker groups at once: phases as futures, groups side by side.

A run's groups (the hybrid actor, a reward worker, ...) need not start one after
another: `start_groups` asks for every group's actors at once, sends each group's
init as soon as its own actors are up, and waits for all inits together, so worker
processes start and load their models concurrently. Each phase keeps its own error
(WorkerCreateError / WorkerInitError naming the role, rank, node and log); when any
group fails, every group is shut down and the first failure (in the order given)
is raised, the others logged.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from rayrl.controller.group_core import GroupCore

logger = logging.getLogger("rayrl.controller")


class PhaseFuture:
    """A create or init phase sent to every rank of a group, not yet waited for.

    `result()` waits for it (within the phase's timeout, counted from when it was
    sent), runs what completes it (retries, process-group forming) and returns the
    group, or raises the phase's error. It runs once; later calls repeat the outcome.
    """

    def __init__(self, group: GroupCore, phase: str, finish: Callable[[], Any]) -> None:
        self.group = group
        self.phase = phase
        self._finish: Callable[[], Any] | None = finish
        self._value: Any = None
        self._error: BaseException | None = None

    def __repr__(self) -> str:
        state = "pending" if self._finish else ("failed" if self._error else "done")
        return f"PhaseFuture({self.group.name!r}, {self.phase}, {state})"

    def result(self) -> Any:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            try:
                self._value = finish()
            except BaseException as err:
                self._error = err
        if self._error is not None:
            raise self._error
        return self._value


def in_background(group: GroupCore, phase: str, work: Callable[[], Any]) -> PhaseFuture:
    """Run `work` (a phase that waits on its own, such as the one formation path of a
    group's init) in a thread now; the PhaseFuture's `result()` joins it and returns its
    value or raises its error. Several groups' phases then run side by side."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = work()
        except BaseException as err:  # noqa: BLE001 - raised by the PhaseFuture
            outcome["error"] = err

    thread = threading.Thread(target=run, name=f"rayrl-{phase}-{group.name}", daemon=True)
    thread.start()

    def finish() -> Any:
        thread.join()
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    return PhaseFuture(group, phase, finish)


def start_groups(
    groups: Sequence[tuple[Any, dict[str, Any]]],
    *,
    create_timeout_s: float,
    init_timeout_s: float,
    init_retries: int = 0,
) -> None:
    """Create and initialise `groups` (pairs of WorkerGroup and its init kwargs)
    concurrently; on any failure shut every group down and raise the first error."""
    errors: list[BaseException] = []
    try:
        created = [(group.create(create_timeout_s, blocking=False), kw) for group, kw in groups]
        inits = []
        for phase, kwargs in created:
            try:
                phase.result()
            except Exception as err:  # noqa: BLE001 - kept, raised after the others finish
                errors.append(err)
                continue
            inits.append(phase.group.init(init_timeout_s, init_retries, blocking=False, **kwargs))
        for phase in inits:
            try:
                phase.result()
            except Exception as err:  # noqa: BLE001 - as above
                errors.append(err)
    except BaseException:
        _shutdown(groups)
        raise
    if errors:
        _shutdown(groups)
        for other in errors[1:]:
            logger.error("worker start-up also failed: %s", other)
        raise errors[0]


def _shutdown(groups: Sequence[tuple[Any, dict[str, Any]]]) -> None:
    for group, _ in groups:
        try:
            group.shutdown()
        except Exception as err:  # noqa: BLE001 - the start-up error matters more
            logger.debug("shutting down %s after a failed start: %s", group.name, err)
