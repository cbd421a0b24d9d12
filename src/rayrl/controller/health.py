"""Health of a worker group: who answered a heartbeat, who is dead, who moved.

`GroupCore.check_health(timeout_s)` pings every rank on the workers' health thread
(answered even while a long call runs) and returns a HealthReport. A HealthMonitor
does that periodically in a driver thread and remembers the ranks that failed, so the
controller can `replace` them at the next step boundary. Replacement itself is always
explicit: nothing here restarts a worker.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rayrl.controller.errors import DEAD_ERRORS, short_error
from rayrl.controller.group_core import GroupCore
from rayrl.controller.waiting import wait_all

logger = logging.getLogger("rayrl.controller")


class TopologyChangedWarning(UserWarning):
    """A replaced worker landed on another node than the one it left."""


@dataclass
class HealthReport:
    """Result of one health check: ranks alive, dead (process gone), silent (no answer),
    or being replaced (skipped: their old process is expected to go)."""

    alive: list[int] = field(default_factory=list)
    dead: dict[int, str] = field(default_factory=dict)
    unresponsive: dict[int, str] = field(default_factory=dict)
    heartbeats: dict[int, dict[str, Any]] = field(default_factory=dict)
    replacing: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every rank answered."""
        return not self.dead and not self.unresponsive

    @property
    def failed(self) -> list[int]:
        """Ranks that are dead or did not answer in time, sorted."""
        return sorted({*self.dead, *self.unresponsive})

    def summary(self) -> str:
        """One line per failed rank, or 'all N ranks healthy'."""
        if self.ok:
            return f"all {len(self.alive)} ranks healthy"
        lines = [f"rank {r}: dead ({why})" for r, why in sorted(self.dead.items())]
        lines += [
            f"rank {r}: missed heartbeat ({why})" for r, why in sorted(self.unresponsive.items())
        ]
        return "\n".join(lines)


@dataclass
class Replacement:
    """What `GroupCore.replace(rank)` did.

    ``bytes_read``: what each rank built (the new ones' `init_worker`) or rebuilt (the
    survivors) during the replacement read from storage (`rayrl.reads`), by rank, over
    all its attempts: the same for every Replacement of one `replace` call. A survivor
    that keeps its weights reads nothing; a new rank whose state a snapshot restore
    brings back reads only what no snapshot holds (a frozen reference policy's shard).
    """

    rank: int
    old_node: str
    new_node: str
    old_pid: int | None
    new_pid: int | None
    generation: int
    spare_used: bool = False
    bytes_read: dict[int, int] = field(default_factory=dict)

    @property
    def moved(self) -> bool:
        """Whether the worker now runs on another node (the topology changed)."""
        return self.old_node != self.new_node

    @property
    def ranks_reloading(self) -> int:
        """How many ranks of the group read anything from storage in the replacement."""
        return sum(1 for n in self.bytes_read.values() if n > 0)


def check_group(group: GroupCore, timeout_s: float) -> HealthReport:
    """Heartbeat every rank of `group` (see GroupCore.check_health).

    The actors are read under the group's lock; a rank whose actor was swapped while
    the heartbeats were out, or that is being replaced, is reported as `replacing`.
    """
    with group.lock:
        asked = {
            r: a for r, a in enumerate(group.actors) if a is not None and r not in group._replacing
        }
        missing = [r for r, a in enumerate(group.actors) if a is None and r not in group._replacing]
        busy = set(group._replacing)
    results, failures = wait_all({r: a.heartbeat.remote() for r, a in asked.items()}, timeout_s)
    with group.lock:
        swapped = {r for r, a in asked.items() if group.actors[r] is not a or r in group._replacing}
        missing = [r for r in missing if group.actors[r] is None and r not in group._replacing]
        report = HealthReport(replacing=sorted(busy | swapped))
        for rank, err in failures.items():
            if rank in swapped:
                continue
            if isinstance(err, DEAD_ERRORS):
                report.dead[rank] = short_error(err)
                group.dead.add(rank)
            else:
                report.unresponsive[rank] = short_error(err)
    report.heartbeats = {r: beat for r, beat in results.items() if r not in swapped}
    report.alive = sorted(report.heartbeats)
    for rank in missing:
        report.dead[rank] = "never created or killed"
    return report


class HealthMonitor:
    """Checks a group's health every `interval_s` in a daemon thread.

    Failed ranks accumulate in `failed` (and `on_failure(report)` is called) until the
    controller handles them, e.g. with `group.replace(rank)` then `monitor.clear(rank)`.
    """

    def __init__(
        self,
        group: GroupCore,
        interval_s: float = 10.0,
        timeout_s: float = 5.0,
        on_failure: Callable[[HealthReport], None] | None = None,
    ) -> None:
        self.group = group
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.on_failure = on_failure
        self.failed: set[int] = set()
        self.last: HealthReport | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> HealthMonitor:
        """Start checking in the background; returns self."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="rayrl-health", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the background thread (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + self.timeout_s + 1)
            self._thread = None

    def clear(self, rank: int) -> None:
        """Forget a failed rank once it has been replaced."""
        self.failed.discard(rank)

    def check(self) -> HealthReport:
        """Run one check now and record its failures."""
        report: HealthReport = self.group.check_health(self.timeout_s)
        self.last = report
        if not report.ok:
            self.failed.update(report.failed)
            logger.warning("health check of %s:\n%s", self.group.name, report.summary())
            if self.on_failure is not None:
                self.on_failure(report)
        return report

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - a monitor must outlive one bad check
                logger.exception("health check of %s failed", self.group.name)

    def __enter__(self) -> HealthMonitor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
