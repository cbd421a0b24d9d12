"""The watchdog: a group call may be slow, but it must keep moving.

A GroupCore with `stage_timeout_s` hands a `Watchdog` to the futures of its calls.
While the driver waits for one, the watchdog asks the ranks still running for their
heartbeat (answered on the workers' health thread) every few seconds: each reports
how long its call has gone without progress (`rayrl.progress`: tokens generated,
micro-batches done, weight buckets sent; or since the call started). A rank idle for
longer than `stage_timeout_s`, or whose heartbeat stays unanswered that long, raises
WorkerHungError naming role, rank, node, pid and log file with the Python stack of
its busy thread; the caller then treats the rank as failed (kill, replace, replay).
A rank that dies fails the wait at once, as without a watchdog.
"""

from __future__ import annotations

import time
from typing import Any, cast

import ray

from rayrl.controller.errors import WorkerHungError
from rayrl.controller.group_core import GroupCore


class Watchdog:
    """Progress checks for the calls of one group (see the module docstring)."""

    def __init__(self, group: GroupCore, stage_timeout_s: float) -> None:
        self.group = group
        self.stage_timeout_s = stage_timeout_s
        self.check_every_s = min(5.0, max(0.2, stage_timeout_s / 4))

    def wait(self, future: Any, timeout: float | None) -> list[Any]:
        """The outputs of `future`'s refs; raises as `ray.get` would (a failed rank,
        GetTimeoutError after `timeout`) or WorkerHungError for a rank without progress."""
        end = None if timeout is None else time.monotonic() + timeout
        pending = list(future.refs)
        silent: dict[int, float] = {}
        next_check = time.monotonic() + self.check_every_s
        while pending:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise ray.exceptions.GetTimeoutError(f"{future.stage}: not done in {timeout} s")
            step = self.check_every_s if left is None else min(self.check_every_s, left)
            ready, pending = ray.wait(pending, num_returns=1, timeout=step, fetch_local=False)
            if ready:
                ray.get(ready)  # a failed rank raises here, before the others finish
                continue
            if pending and time.monotonic() >= next_check:
                running = [
                    r for r, ref in zip(future.ranks, future.refs, strict=True) if ref in pending
                ]
                self.check(future.stage, running, silent, future._describe)
                next_check = time.monotonic() + self.check_every_s
        return cast("list[Any]", ray.get(future.refs))

    def check(
        self, stage: str, ranks: list[int], silent: dict[int, float], describe: Any = None
    ) -> None:
        """Raise WorkerHungError for the first of `ranks` past the deadline; `describe`
        names a rank in the error (the group's description by default)."""
        self._describe = describe or self.group.describe
        now = time.monotonic()
        actors = {r: self.group.actors[r] for r in ranks if self.group.actors[r] is not None}
        beats = {r: a.heartbeat.remote() for r, a in actors.items()}
        ready, _ = ray.wait(list(beats.values()), num_returns=len(beats), timeout=5.0)
        for rank, ref in beats.items():
            if ref not in ready:
                silent.setdefault(rank, now)
                if now - silent[rank] > self.stage_timeout_s:
                    self._raise(
                        stage,
                        rank,
                        f"its heartbeat went unanswered for {now - silent[rank]:.0f} s",
                        actors[rank],
                    )
                continue
            silent.pop(rank, None)
            try:
                beat = ray.get(ref)
            except Exception:  # noqa: BLE001 - a dead rank fails its call ref too
                continue
            if beat["busy"] and beat["idle_s"] > self.stage_timeout_s:
                moved = ", ".join(f"{k} {v}" for k, v in sorted(beat["progress"].items()))
                self._raise(
                    stage,
                    rank,
                    f"no progress in {beat['busy']} for {beat['idle_s']:.0f} s "
                    f"(trainer.stage_timeout_s={self.stage_timeout_s:g}; in it for "
                    f"{beat['busy_s']:.0f} s{', phase ' + beat['phase'] if beat['phase'] else ''}"
                    f"{', progress so far: ' + moved if moved else ''})",
                    actors[rank],
                )

    def _raise(self, stage: str, rank: int, cause: str, actor: Any) -> None:
        try:
            stack = ray.get(actor._rayrl_stack.remote(), timeout=5.0)
        except Exception:  # noqa: BLE001 - a frozen process cannot say where it is
            stack = ""
        raise WorkerHungError(stage, self._describe(rank), cause, stack)
