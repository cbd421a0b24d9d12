"""Step replay: a step that loses a worker is brought back and run again, to the same end.

`StepReplay.run(work)` runs a unit of work (a step, or the checkpoint and validation
after it) and, when a worker dies or hangs in it:

1. finds the failed ranks of every group (the error's rank, dead or silent ranks of a
   health check: a lost node takes several at once) and counts them against
   `trainer.max_worker_restarts` (per rank, per unit of work);
2. brings each group with failed ranks back (`WorkerGroup.replace`: busy survivors
   aborted, new workers in their bundles or in spares, the process group re-formed,
   the survivors' engines rebuilt on the weights they hold);
3. restores the groups that hold state to the last step boundary, from the snapshot
   taken there (`GroupSnapshot`, `trainer.step_snapshots`; with
   `trainer.snapshot_replicas` a rank whose node was lost takes its copy on another
   node), or, where that is gone (a lost node took it), from the boundary before it,
   kept in memory until the last one is stored whole (`Boundary`: the run goes back
   one step further), or else from the last checkpoint: then the run rewinds to that
   checkpoint's step (`Rewound`);
4. runs the work again: the step's calls that had finished are reused, the updates of
   the restored groups run again, with the same inputs and seeds (`StageCalls`).

A snapshot of the model roles is taken at every step boundary (after the updates),
and its time is the step's `timing_s/snapshot`, counted in `timing_s/step` and
`perf/throughput` too (it is work every step does, as verl's step timer holds its
checkpoint saves): the capture into host memory, and any wait for the last
snapshot's copy into the object store, which otherwise overlaps the next step's
generation (`GroupSnapshot`). On CPU the outcome is bitwise that of
a run without the failure. `recoveries` and `ledger` (the prompt uids each step
trained, in order) record what happened, for the chaos harness.

Each recovery's record says what its replacements read from storage: ``bytes_read``
(group -> rank -> bytes: the new ranks' builds, the survivors' rebuilds) and
``ranks_reloading`` (how many ranks read anything; a survivor keeps its weights, a new
rank restored from a snapshot reads at most what no snapshot holds, such as its shard
of a frozen reference policy; a rewind to the run's start reloads from one read). The
step that follows a recovery reports them as `recovery/ranks_reloading` and
`recovery/bytes_read` (summed over its recoveries, `take_recovery_metrics`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from rayrl.controller.errors import WorkerCallError, WorkerError, WorkerHungError
from rayrl.controller.members import GroupMembers
from rayrl.controller.recovery import (
    GroupSnapshot,
    SnapshotLostError,
    buddy_nodes,
    stored_whole,
)
from rayrl.trainer.stage_calls import StageCalls
from rayrl.trainer.state import Stateful, capture, restore

log = logging.getLogger("rayrl.trainer")
Result = TypeVar("Result")  # what a unit of work `StepReplay.run` runs returns


# `trainer.step_snapshots=auto` keeps snapshots while they need at most this share of
# the object store: each step's is the whole trainable state (weights and Adam moments)
SNAPSHOT_STORE_SHARE = 0.5


def nodes_over(
    need: dict[str, int], stores: dict[str, float], share: float
) -> dict[str, tuple[int, float]]:
    """The nodes whose snapshot bytes (`need`, by node id) exceed `share` of their object
    store (`stores`, by node id), with both figures. Bytes on nodes of unknown id ("?")
    are weighed against the smallest store."""
    out = {}
    smallest = min(stores.values(), default=0.0)
    for node, nbytes in need.items():
        store = stores.get(node, smallest)
        if nbytes > share * store:
            out[node] = (nbytes, store)
    return out


def bytes_by_node(
    homes: list[str], nbytes: list[int], alive: list[str], copies: int
) -> Counter[str]:
    """What one group's snapshots put in each node's object store: each rank's
    (`nbytes`) on its own node (`homes`), and on each of its `copies` buddy nodes
    (`rayrl.controller.recovery.buddy_nodes` among the `alive` ones)."""
    need: Counter[str] = Counter()
    for home, buddies, size in zip(homes, buddy_nodes(homes, alive, copies), nbytes, strict=True):
        for node in [home, *buddies]:
            need[node] += size
    return need


class Rewound(Exception):  # noqa: N818 - a change of course, not an error
    """The run went back to an earlier step (its last checkpoint): restart the loop."""

    def __init__(self, step: int) -> None:
        super().__init__(f"rewound to step {step}")
        self.step = step


@dataclass
class Boundary:
    """A step boundary held in memory while the next one is being stored: the steps
    done there, the stateful groups' snapshots, and the driver's parts with their
    captured states. A boundary's snapshot is handed to the object store and copied
    onto other nodes while the next step runs; a rank or node lost before that is
    done takes it away, and the run goes back to this one instead of a checkpoint."""

    step: int
    snapshots: dict[str, GroupSnapshot]
    parts: dict[str, Stateful]
    states: dict[str, dict[str, Any]]


class WorkerRestartLimitError(RuntimeError):
    """A rank failed more than `trainer.max_worker_restarts` times at the same point."""


class Group(GroupMembers, Protocol):
    """What replay needs of a worker group (`rayrl.controller.WorkerGroup`): what its
    snapshots take and restore (`GroupMembers`), its health and its replacements."""

    @property
    def forms_process_group(self) -> bool: ...

    def check_health(self, timeout_s: float = ...) -> Any: ...

    def replace(self, ranks: list[int], timeout_s: float = ..., retries: int = ...) -> Any: ...


@dataclass(frozen=True)
class ReplayPolicy:
    """How hard replay tries (`trainer.max_worker_restarts`, `trainer.step_snapshots`,
    `trainer.snapshot_replicas`: copies of each rank's snapshot on other nodes) and how
    long a replacement may take to start (`resources.init_timeout_s`,
    `resources.init_retries`)."""

    max_restarts: int = 3
    snapshots: bool | str = "auto"
    init_timeout_s: float = 600.0
    init_retries: int = 1
    snapshot_replicas: int = 0


class StepReplay:
    """Recovery of a run's groups around each unit of work (module docstring).

    Args:
        groups: every group of the run (health checks look at all of them).
        stateful: the groups whose state a step changes (snapshots, restores).
        calls: the step's kept calls (`StageCalls`), reused by a replayed step.
        policy: restart limit, snapshot mode, replacement timeouts.
        rewind: called when a group cannot be restored from memory (its snapshot is
            lost): puts the run back at its last checkpoint (or its start) and returns
            the step it continues from.
        print_fn: receives the run's messages.
        on_replaced: called after workers were replaced, before their state is
            restored (the run rewrites its `workers.json` there).
        on_back: called with the step the run went back to from memory (the boundary
            before a lost snapshot's): the run drops its metrics after it there.
    """

    def __init__(
        self,
        groups: Sequence[Group],
        stateful: Sequence[Group],
        calls: StageCalls,
        policy: ReplayPolicy,
        rewind: Callable[[str], int],
        print_fn: Callable[[str], None] = print,
        on_replaced: Callable[[], None] = lambda: None,
        on_back: Callable[[int], None] = lambda step: None,
    ) -> None:
        self.groups, self.stateful, self.calls = groups, stateful, calls
        self.on_replaced, self.on_back = on_replaced, on_back
        self.policy, self.rewind, self.print = policy, rewind, print_fn
        self.use_snapshots = policy.snapshots
        self.snapshots: dict[str, GroupSnapshot] = {}
        self.previous: Boundary | None = None  # until `snapshots` are stored whole
        self._previous_lock = threading.Lock()
        self.recoveries: list[dict[str, Any]] = []
        self.ledger: list[tuple[int, list[str]]] = []
        self._reported = 0  # recoveries already in a step's metrics
        self._told_replicas = False

    # ------------------------------------------------------------ boundaries
    def start(self) -> None:
        """The first boundary (a fresh or resumed run): snapshot the stateful groups
        (sizing them first under `trainer.step_snapshots=auto`). A worker lost meanwhile
        is replaced as in a step; with no snapshot yet to restore, the run goes back to
        its last checkpoint or its start (`rewind`), which takes the snapshots anew."""
        with contextlib.suppress(Rewound):
            self.snapshots = self.run(self._take, "the first snapshot")

    def _snapshots_fit(self) -> bool:
        """`trainer.step_snapshots=auto`: whether every node's share of the stateful
        groups' snapshots (each rank's goes into its own node's object store, and each
        of its `trainer.snapshot_replicas` copies into a buddy node's) fits
        `SNAPSHOT_STORE_SHARE` of that node's store; says which node does not."""
        import ray

        alive = [node for node in ray.nodes() if node.get("Alive")]
        stores = {
            str(node["NodeID"]): node["Resources"].get("object_store_memory", 0.0) for node in alive
        }
        need: Counter[str] = Counter()
        for group in self.stateful:
            infos = getattr(group, "infos", None) or [{}] * group.world_size
            homes = [str(infos[r].get("node_id") or "?") for r in range(group.world_size)]
            sizes = GroupSnapshot.rank_nbytes(group)
            need += bytes_by_node(homes, sizes, list(stores), self.policy.snapshot_replicas)
        over = nodes_over(need, stores, SNAPSHOT_STORE_SHARE)
        if not over:
            return True
        node, (needs, store) = next(iter(over.items()))
        self.print(
            f"step snapshots off (trainer.step_snapshots=auto): node {node[:8]}'s ranks hold "
            f"{needs / 2**30:.1f} GiB of trainable state (their own and copies of other "
            f"nodes'), more than "
            f"{SNAPSHOT_STORE_SHARE:.0%} of its object store ({store / 2**30:.1f} GiB)"
            + (f", and {len(over) - 1} more node(s) likewise" if len(over) > 1 else "")
            + "; a lost worker rewinds the run to its last checkpoint (set "
            "trainer.save_freq), or set trainer.step_snapshots=true"
        )
        return False

    def _take(self) -> dict[str, GroupSnapshot]:
        if self.use_snapshots == "auto":
            self.use_snapshots = self._snapshots_fit()
        if not self.use_snapshots:
            return {}
        last, copies = self.snapshots, self.policy.snapshot_replicas
        if copies and not self._told_replicas:
            self._told_replicas = True
            self._check_replicas(copies)
        return {
            g.name: GroupSnapshot.take(g, previous=last.get(g.name), replicas=copies)
            for g in self.stateful
        }

    def _check_replicas(self, copies: int) -> None:
        """Say so when the cluster has too few nodes for `trainer.snapshot_replicas`."""
        import ray

        nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
        if nodes <= copies:
            self.print(
                f"WARNING: trainer.snapshot_replicas={copies} copies each rank's step snapshot "
                f"onto other nodes, but the cluster has {nodes} node(s): "
                f"{'no copy is' if nodes == 1 else f'only {nodes - 1} copies are'} kept, and "
                "the loss of a node rewinds the run to its last checkpoint"
            )

    def run_step(
        self,
        step: int,
        work: Callable[[], tuple[dict[str, Any], list[str]]],
        parts: dict[str, Stateful],
    ) -> dict[str, float]:
        """Step `step`: `work()` returns its metrics and the prompt uids it trained; it
        is replayed until it completes, each attempt from the same driver state
        (`parts`, captured here), then the next boundary's snapshot is taken (in the
        same unit of work: a failure while taking it replays the step)."""
        before = capture(parts)
        self.calls.new_step()

        def attempt() -> tuple[dict[str, Any], list[str], dict[str, Any]]:
            self.calls.new_attempt()
            restore(parts, before)
            metrics, trained = work()
            return metrics, trained, self._take()

        metrics, trained, snapshots = self.run(attempt, f"step {step + 1}")
        self._keep_until_stored(Boundary(step, self.snapshots, parts, before), snapshots)
        self.snapshots = snapshots
        _charge_to_step(metrics, sum(s.seconds for s in snapshots.values()))
        self.ledger.append((step, list(trained)))
        return metrics

    def _keep_until_stored(self, boundary: Boundary, newer: dict[str, GroupSnapshot]) -> None:
        """Hold `boundary` as `previous` until the `newer` snapshots are stored whole (a
        thread waits for their hand-overs and copies, then lets it go): the object
        stores hold two boundaries only while the newer one is on its way."""
        pending = [ref for snapshot in newer.values() for ref in snapshot.pending()]
        kept = boundary if boundary.snapshots and pending else None
        with self._previous_lock:
            self.previous = kept
        if kept is None:
            return

        def let_go() -> None:
            if stored_whole(pending):
                with self._previous_lock:
                    if self.previous is boundary:
                        self.previous = None

        threading.Thread(target=let_go, name="rayrl-boundary-stored", daemon=True).start()

    def _back_to_previous(self, err: SnapshotLostError) -> int | None:
        """Every stateful group and the driver's parts back to the boundary before the
        lost snapshot's (`previous`), from memory; the step it is at, or None where
        there is none or it is gone too."""
        with self._previous_lock:
            boundary, self.previous = self.previous, None
        if boundary is None:
            return None
        try:
            for group in self.stateful:
                boundary.snapshots[group.name].restore(group)
        except SnapshotLostError:
            return None
        restore(boundary.parts, boundary.states)
        self.snapshots = boundary.snapshots
        self._forget_steps_from(boundary.step)
        self.recoveries[-1]["back_to"] = boundary.step
        self.on_back(boundary.step)
        self.print(
            f"WARNING: {err}; back to the boundary before it (step {boundary.step}), kept "
            "in memory until the last one was stored whole (no checkpoint read): the steps "
            "after it run again"
        )
        return boundary.step

    @property
    def can_undo(self) -> bool:
        """Whether every stateful group can go back to the last boundary from memory."""
        return all(g.name in self.snapshots for g in self.stateful)

    def undo(self) -> None:
        """Put the stateful groups back to the last boundary (an abandoned step)."""
        for group in self.stateful:
            self.snapshots[group.name].restore(group)

    # ------------------------------------------------------------------ work
    def run(self, work: Callable[[], Result], what: str) -> Result:
        """`work()`, brought back and run again after each recoverable failure."""
        failures: Counter[tuple[str, int]] = Counter()
        while True:
            try:
                return work()
            except WorkerError as err:
                self.recover(err, what, failures)

    def recover(self, err: WorkerError, what: str, failures: Counter[tuple[str, int]]) -> None:
        """Bring the failed groups back and restore their state (module docstring)."""
        if self.policy.max_restarts <= 0 or not isinstance(err, WorkerCallError):
            raise err
        start = time.time()
        failed = self._failed_ranks(err)
        if not failed:
            raise err  # an error in the code, not a lost worker: running again fails again
        self._count(err, failed, failures)
        self.print(f"recovering from a worker failure in {what}: {_one_line(err)}")
        record: dict[str, Any] = {
            "what": what,
            "stage": err.stage,
            "replaced": [],
            "start": start,
            "bytes_read": {},
            "ranks_reloading": 0,
        }
        self.recoveries.append(record)
        for group, ranks in failed.items():
            self.replace(group, sorted(ranks))
        self.on_replaced()
        self.calls.forget({g.name for g in failed})
        try:
            for group in self.stateful:
                if group in failed:
                    self._restore(group)
        finally:
            record["end"] = time.time()
            record["seconds"] = record["end"] - start
        self.print(
            f"recovered in {record['seconds']:.1f} s ({_reloading(record)}); running {what} again"
        )

    def replace(self, group: Group, ranks: list[int]) -> None:
        """Replace `ranks` of `group` within the recovery under way (its record gets what
        was replaced and what the group read from storage); warns of each move. The
        run's rewind to its start replaces its stateful groups whole through here."""
        record = self.recoveries[-1]
        policy = self.policy
        replaced = group.replace(
            ranks, timeout_s=policy.init_timeout_s, retries=policy.init_retries
        )
        if replaced:
            read = record["bytes_read"].setdefault(group.name, {})
            for rank, nbytes in replaced[0].bytes_read.items():
                read[rank] = read.get(rank, 0) + nbytes
            record["ranks_reloading"] = sum(
                1 for ranks_read in record["bytes_read"].values() for n in ranks_read.values() if n
            )
        for done in replaced:
            record["replaced"].append(
                {
                    "group": group.name,
                    "rank": done.rank,
                    "old_pid": done.old_pid,
                    "new_pid": done.new_pid,
                    "old_node": done.old_node,
                    "new_node": done.new_node,
                }
            )
            if done.moved:
                formed = f"; its process group re-formed as generation {done.generation}"
                self.print(
                    f"WARNING: {group.name} rank {done.rank} moved from node {done.old_node} "
                    f"to node {done.new_node}{formed if group.forms_process_group else ''}"
                )

    def take_recovery_metrics(self) -> dict[str, float]:
        """`recovery/ranks_reloading` and `recovery/bytes_read` of the recoveries since the
        last call (none: {}), for the step that follows them."""
        new, self._reported = self.recoveries[self._reported :], len(self.recoveries)
        if not new:
            return {}
        return {
            "recovery/ranks_reloading": float(sum(r["ranks_reloading"] for r in new)),
            "recovery/bytes_read": float(
                sum(n for r in new for ranks in r["bytes_read"].values() for n in ranks.values())
            ),
        }

    def _restore(self, group: Group) -> None:
        snap = self.snapshots.get(group.name)
        try:
            if snap is None:
                raise SnapshotLostError(f"{group.name}: no step snapshot (trainer.step_snapshots)")
            copies = snap.restore(group)
            if copies:
                self.recoveries[-1].setdefault("from_replicas", {})[group.name] = copies
                where = ", ".join(f"rank {r} from node {n[:8]}" for r, n in sorted(copies.items()))
                self.print(
                    f"{group.name}: restored from the step snapshot's copies on other nodes "
                    f"({where}): the primaries were lost with their node"
                )
        except SnapshotLostError as err:
            back = self._back_to_previous(err)
            if back is not None:
                raise Rewound(back) from err
            self.snapshots.clear()
            step = self.rewind(str(err))
            self._forget_steps_from(step)
            self.snapshots = self._take()
            raise Rewound(step) from err

    def _forget_steps_from(self, step: int) -> None:
        """Drop the ledger's steps from `step` on: they run again and are recorded again."""
        self.ledger = [(s, uids) for s, uids in self.ledger if s < step]

    def _failed_ranks(self, err: WorkerError) -> dict[Any, set[int]]:
        """Failed ranks by group: the error's own when it is dead or hung, and those a
        health check finds dead or silent (death is seen with a lag: checked a while)."""
        deadline = time.monotonic() + (5.0 if not (err.dead or err.hung) else 0.0)
        while True:
            failed: dict[Any, set[int]] = {}
            for group in self.groups:
                ranks = set(group.check_health(timeout_s=10.0).failed)
                if (
                    err.dead or isinstance(err, WorkerHungError)
                ) and err.worker.group == group.name:
                    ranks.add(err.rank)
                if ranks:
                    failed[group] = ranks
            if failed or time.monotonic() >= deadline:
                return failed
            time.sleep(0.5)

    def _count(
        self, err: WorkerError, failed: dict[Any, set[int]], failures: Counter[tuple[str, int]]
    ) -> None:
        limit = self.policy.max_restarts
        for group, ranks in failed.items():
            for rank in ranks:
                failures[(group.name, rank)] += 1
                if failures[(group.name, rank)] > limit:
                    worker = err.worker if err.worker.group == group.name else group.describe(rank)
                    raise WorkerRestartLimitError(
                        f"{group.role} rank {rank} failed {failures[(group.name, rank)]} times in "
                        f"'{err.stage}' of the same step (trainer.max_worker_restarts="
                        f"{limit}); stopping the run.\n  node {worker.node_id}, "
                        f"pid {worker.pid}, worker log: {worker.log_file or '?'}\n  last "
                        f"failure: {_one_line(err)}\n  what to do: read the worker log; a rank "
                        "that dies at the same point each time is not a passing fault (out of "
                        "memory? a bad batch?)"
                    ) from err


def _reloading(record: dict[str, Any]) -> str:
    """How many ranks read weights from storage in a recovery, and how much."""
    total = sum(n for ranks in record["bytes_read"].values() for n in ranks.values())
    return f"{record['ranks_reloading']} rank(s) read weights from storage, {total / 2**20:.1f} MiB"


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def _charge_to_step(metrics: dict[str, float], seconds: float) -> None:
    """Add the boundary snapshot's ``seconds`` to the step: `timing_s/snapshot`, and
    `timing_s/step` and `perf/throughput` (tokens per second of the whole step)."""
    metrics["timing_s/snapshot"] = seconds
    step = metrics.get("timing_s/step")
    if step is None:
        return
    metrics["timing_s/step"] = step + seconds
    if "perf/throughput" in metrics and step + seconds > 0:
        metrics["perf/throughput"] *= step / (step + seconds)
