"""Replicas: one-rank worker groups on a pool's bundles, kept at strength and grown.

A `ReplicaSet` holds independent copies of one worker (rollout replicas, say: no
process group between copies), each a `WorkerGroup` of ``ranks_per_replica``
consecutive bundles of a `ResourcePool` (one rank a bundle; several when a copy is
split over ranks, e.g. a tensor-parallel model: they must share a node). It knows nothing of what they compute; its caller calls
them and tells it when one is lost (`lose`). It places and replaces them only through
the pool and the groups' own formation path:

- `start` creates and initialises one replica per ``ranks_per_replica`` bundles of
  the pool, side by side;
- a replica lost on a live node is brought up again in its bundles by its group
  (`WorkerGroup.replace` of all its ranks: the formation path every worker group
  uses, which re-forms its process group when it has one);
- a replica whose node is gone is shut down, its bundles given back if they were extra
  ones, and as many bundles are asked of the pool on one node
  (`ResourcePool.request_extra`): they are placed whenever the cluster has room (a
  node joins, an autoscaler adds one), and a new replica starts on them;
- with ``max_size`` above the pool's size, one request is kept open so that the set
  grows when a node joins, up to ``max_size``: replicas running, starting and
  requested never exceed it.

Replacements and starts run on threads of their own; `members` lists the replicas
ready for calls, `events` what happened (``lost``, ``joined``, ``stopped``), and
``on_join(member)`` is called (under the set's lock) when a new or replaced replica is
ready. Starts that fail `MAX_FAILED_STARTS` times in a row leave `error` set.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rayrl.cluster.bundle import Bundle
from rayrl.cluster.pool import ExtraRequest, ResourcePool
from rayrl.controller.group import WorkerGroup
from rayrl.controller.placement import alive_nodes
from rayrl.controller.startup import start_groups

__all__ = ["MAX_FAILED_STARTS", "Member", "ReplicaSet"]

log = logging.getLogger("rayrl.controller")
MAX_FAILED_STARTS = 3  # new replicas failing to start in a row before `error` is set


@dataclass
class Member:
    """One replica: its name, its group and when it joined."""

    name: str
    group: WorkerGroup
    joined: float = field(default_factory=time.time)

    @property
    def bundles(self) -> list[Bundle]:
        return list(self.group.bundles)

    @property
    def node(self) -> str:
        return self.group.bundles[0].node_id


class ReplicaSet:
    """Replicas of one worker kept at strength (module docstring).

    Args:
        pool: the reserved pool whose bundles the replicas start on.
        make_group: ``make_group(name, bundles)`` -> an uninitialised group of them.
        init_kwargs: the `init_worker` keyword arguments of a starting replica (called
            for each start, so it sees the newest state).
        max_size: the most replicas (None: the pool's size).
        timeouts: ``create_timeout_s``, ``init_timeout_s``, ``init_retries``.
        on_join: called with each replica that joins after `start` (under the lock).
        print_fn: the run's messages.
        label: what a replica is called in them ("rollout replica").
        ranks_per_replica: bundles (ranks) of one replica, consecutive in the pool's
            rank order (which keeps a node's bundles together).
    """

    def __init__(
        self,
        pool: ResourcePool,
        make_group: Callable[[str, list[Bundle]], WorkerGroup],
        init_kwargs: Callable[[], dict[str, Any]],
        *,
        max_size: int | None = None,
        timeouts: dict[str, float] | None = None,
        on_join: Callable[[Member], None] | None = None,
        print_fn: Callable[[str], None] = print,
        label: str = "replica",
        ranks_per_replica: int = 1,
    ) -> None:
        self.pool, self.make_group, self.init_kwargs = pool, make_group, init_kwargs
        self.max_size = max_size or pool.spec.world_size // ranks_per_replica
        self.timeouts = {"create_timeout_s": 120.0, "init_timeout_s": 600.0, "init_retries": 0}
        self.timeouts.update(timeouts or {})
        self.on_join, self.print, self.label = on_join, print_fn, label
        self.ranks = ranks_per_replica
        self.lock = threading.RLock()
        self.members: list[Member] = []
        self.events: list[dict[str, Any]] = []
        self.error: BaseException | None = None
        self._requests: dict[Any, ExtraRequest] = {}  # ready ref -> request
        self._starting = 0
        self._failed_starts = 0
        self._names = 0
        self._stopped = threading.Event()

    # -------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """A replica on every ``ranks_per_replica`` bundles of the pool, created and
        initialised side by side."""
        bundles, k = self.pool.bundles, self.ranks
        made = [
            self.make_group(self._name(), bundles[i : i + k]) for i in range(0, len(bundles), k)
        ]
        t = self.timeouts
        start_groups(
            [(group, self.init_kwargs()) for group in made],
            create_timeout_s=t["create_timeout_s"],
            init_timeout_s=t["init_timeout_s"],
            init_retries=int(t["init_retries"]),
        )
        with self.lock:
            self.members = [Member(group.name, group) for group in made]
            self._grow()

    def stop(self) -> None:
        """Shut every replica down and withdraw the open requests."""
        self._stopped.set()
        with self.lock:
            for member in self.members:
                self.events.append(self._event("stopped", member))
                member.group.shutdown()
            self.members = []
            for request in self._requests.values():
                self.pool.cancel_extra(request)
            self._requests.clear()

    @property
    def pending(self) -> list[Any]:
        """The refs of the open bundle requests (wait on them; then `placed(ref)`)."""
        with self.lock:
            return list(self._requests)

    @property
    def starting(self) -> int:
        """Replicas being started or replaced now."""
        with self.lock:
            return self._starting

    @property
    def size(self) -> int:
        """Replicas running, starting and requested."""
        with self.lock:
            return len(self.members) + self._starting + len(self._requests)

    # ---------------------------------------------------------------- changes
    def lose(self, member: Member, err: BaseException) -> None:
        """`member` died (a process of it, or its node): out of the set; brought up again
        in its bundles when its node is alive, else bundles are asked of the cluster."""
        with self.lock:
            if member not in self.members:
                return
            self.members.remove(member)
            alive = member.node in alive_nodes()
            self.events.append(self._event("lost", member))
            where = (
                "its node is alive: new processes in its bundles"
                if alive
                else "its node is gone: bundles are asked of the cluster"
            )
            self.print(
                f"WARNING: {self.label} {member.name} lost ({_one_line(err)}); training goes "
                f"on with {len(self.members)} replica(s); {where}"
            )
            if alive:
                self._starting += 1
                self._in_thread(lambda: self._replace(member))
            else:
                member.group.shutdown()
                self._release(member.bundles)
                self._grow()

    def placed(self, ref: Any) -> None:
        """An open request was placed: a new replica starts on its bundles. A group that
        cannot even be made (its actor class refused, its bundles unreadable) counts as
        a failed start: the bundles go back and others are asked for."""
        with self.lock:
            request = self._requests.pop(ref, None)
            if request is None:
                return
            self._starting += 1
            bundles: list[Bundle] = []
            try:
                bundles = self.pool.claim_extra(request)
                group = self.make_group(self._name(), bundles)
            except Exception as err:  # noqa: BLE001 - counted as a failed start
                if not bundles:
                    self.pool.cancel_extra(request)
                self._failed(err, bundles)
                return
        self._in_thread(lambda: self._start_new(group))

    def check_nodes(self, idle: list[Member]) -> None:
        """Lose the `idle` members (no call in flight that would fail for them) whose
        node is gone."""
        alive = alive_nodes()
        for member in idle:
            if member.node not in alive:
                self.lose(member, RuntimeError(f"node {member.node} is gone"))

    # ----------------------------------------------------------------- starts
    def _replace(self, member: Member) -> None:
        t = self.timeouts
        ranks = list(range(member.group.world_size))
        try:
            member.group.replace(
                ranks, timeout_s=t["init_timeout_s"], retries=int(t["init_retries"])
            )
        except Exception as err:  # noqa: BLE001 - counted; bundles are asked for instead
            member.group.shutdown()
            self._failed(err, member.bundles)
            return
        self._joined(Member(member.name, member.group))

    def _start_new(self, group: WorkerGroup) -> None:
        t = self.timeouts
        try:
            group.create(t["create_timeout_s"])
            group.init(t["init_timeout_s"], int(t["init_retries"]), **self.init_kwargs())
        except Exception as err:  # noqa: BLE001 - counted; the bundles are asked for again
            group.shutdown()
            self._failed(err, list(group.bundles))
            return
        self._joined(Member(group.name, group))

    def _joined(self, member: Member) -> None:
        with self.lock:
            self._starting -= 1
            self._failed_starts = 0
            if self._stopped.is_set():
                member.group.shutdown()
                return
            self.members.append(member)
            self.events.append(self._event("joined", member))
            if self.on_join is not None:
                self.on_join(member)
        self.print(
            f"{self.label} {member.name} joined on node {member.node[:8]} "
            f"({len(self.members)} replica(s))"
        )

    def _failed(self, err: BaseException, bundles: list[Bundle]) -> None:
        with self.lock:
            self._starting -= 1
            self._failed_starts += 1
            self._release(bundles)
            self.print(f"WARNING: a new {self.label} failed to start: {_one_line(err)}")
            if self._failed_starts >= MAX_FAILED_STARTS:
                self.error = RuntimeError(
                    f"{self._failed_starts} new {self.label}s in a row failed to start; "
                    f"the last: {_one_line(err)} (see its worker log)"
                )
            elif not self._stopped.is_set():
                self._grow()

    def _grow(self) -> None:
        """Ask for bundles until replicas, starts and requests reach `max_size`."""
        while len(self.members) + self._starting + len(self._requests) < self.max_size:
            request = self.pool.request_extra(self.ranks)
            self._requests[request.ready] = request

    def _release(self, bundles: list[Bundle]) -> None:
        """Give back the extra bundles among ``bundles`` (the pool's own stay)."""
        done = set()
        for bundle in bundles:
            if bundle.pg.id not in done:
                done.add(bundle.pg.id)
                self.pool.release_extra(bundle)

    def _in_thread(self, fn: Callable[[], None]) -> None:
        threading.Thread(target=fn, name="rayrl-replica-start", daemon=True).start()

    def _name(self) -> str:
        self._names += 1
        return f"{self.pool.run}/{self.pool.spec.name}{self._names - 1}"

    @staticmethod
    def _event(kind: str, member: Member) -> dict[str, Any]:
        return {"event": kind, "replica": member.name, "node": member.node, "time": time.time()}


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
