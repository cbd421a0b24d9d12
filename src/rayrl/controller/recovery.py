"""Step-boundary snapshots of a group, owned by the driver, and putting them back.

    snap = GroupSnapshot.take(group)      # every rank's `snapshot_state()`
    ...                                   # a rank dies; group.replace(rank) re-forms
    snap.restore(group)                   # every rank back to the snapshot, new ones too
    nxt = GroupSnapshot.take(group, previous=snap)   # the next boundary's
    GroupSnapshot.take(group, replicas=1)            # and a copy on another node

Each rank returns its state as the result of a call, so the object sits in the object
store of the rank's node (host RAM, not the worker's heap) and is owned by the driver,
not by the worker: it outlives the worker's death, and a replaced rank gets its own
part (its shard, when sharded) back. Only the loss of the node that holds it takes it
away; `restore` then raises SnapshotLostError and the caller falls back to the last
checkpoint. A rank that dies while a snapshot is taken or restored raises
WorkerCallError, as any group call does.

With ``replicas=k`` each rank's state is also copied onto k other nodes (`buddy_nodes`):
a small task pinned to each buddy node (`NodeAffinitySchedulingStrategy`) takes the
state as its argument and returns it, so the driver owns a second object, stored in
the buddy's object store. `restore` hands each rank its copies, those on nodes still
alive first; the rank takes the first still there (`Worker._rayrl_restore_from`), so
the loss of a node costs one step, not a rewind to the last checkpoint.

Taking one has two phases. Every rank captures its state into host memory (the
driver waits: the state must be copied before the next update changes it), then
hands it over on a thread of its own (`Worker._rayrl_snapshot_publish`) while the next
calls run: Ray's copy into the object store (gigabytes for a GPU model's weights and
Adam moments) overlaps the next step's generation instead of adding to the step.
The next `take` (``previous``) and `restore` wait for the hand-over first; a rank
that died before finishing it left no snapshot (SnapshotLostError).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray import ObjectRef
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rayrl.controller.dispatch import collect_list
from rayrl.controller.errors import WorkerCallError
from rayrl.controller.future import GroupFuture
from rayrl.controller.members import GroupMembers

LOST_ERRORS = (ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError)
logger = logging.getLogger("rayrl.controller")


class SnapshotLostError(RuntimeError):
    """A rank's snapshot object is gone (the node holding it was lost)."""


def buddy_nodes(homes: list[str], alive: list[str], copies: int) -> list[list[str]]:
    """For each rank (its node in `homes`), the `copies` other nodes its snapshot is
    copied onto: the next nodes after its own, in a fixed order of the nodes that
    hold ranks, then of the other `alive` nodes (fewer where the cluster has fewer
    nodes). Ranks of one node share their buddies."""
    ranked = sorted(set(homes) & set(alive))
    rest = sorted(set(alive) - set(homes))
    out = []
    for home in homes:
        at = ranked.index(home) if home in ranked else -1
        others = ranked[at + 1 :] + ranked[: max(at, 0)] + rest
        out.append(others[:copies])
    return out


@ray.remote(num_cpus=0, num_returns=2, max_retries=0)  # type: ignore[untyped-decorator]  # ray is not followed
def _copy(state: Any) -> tuple[bool, Any]:
    """(done, `state`): run on a buddy node, whose object store then holds the copy."""
    return True, state


@dataclass
class GroupSnapshot:
    """One ObjectRef per rank of a group's state, and what taking it cost; ``replicas``:
    per rank, its copies on other nodes (`buddy_nodes`)."""

    group: str
    refs: list[ObjectRef]
    seconds: float
    handed: list[ObjectRef] = field(default_factory=list)  # the ranks' hand-overs done
    replicas: list[list[ObjectRef]] = field(default_factory=list)
    homes: list[str] = field(default_factory=list)  # each rank's node when taken
    replica_nodes: list[list[str]] = field(default_factory=list)
    copied: list[ObjectRef] = field(default_factory=list)  # the copies' "done"

    @classmethod
    def take(
        cls,
        group: GroupMembers,
        timeout_s: float | None = None,
        previous: GroupSnapshot | None = None,
        replicas: int = 0,
    ) -> GroupSnapshot:
        """Every rank's `snapshot_state()`, captured (waited for) and handed to the
        object store in the background, then (``replicas``) copied onto that many
        other nodes each, in the background too; ``previous`` (the last snapshot of
        `group`) is waited for first, its time counted in ``seconds``."""
        start = time.perf_counter()
        if previous is not None:
            previous.wait_stored(group, timeout_s)
        captured = [
            group.actor_handle(r, "snapshot")._rayrl_snapshot.remote()
            for r in range(group.world_size)
        ]
        _future(group, captured, "snapshot").get(timeout_s)
        calls = [
            group.actor_handle(r, "snapshot")
            ._rayrl_snapshot_publish.options(num_returns=2)
            .remote()
            for r in range(group.world_size)
        ]
        snap = cls(
            group.name,
            [state for _, state in calls],
            time.perf_counter() - start,
            [done for done, _ in calls],
        )
        if replicas > 0:
            snap._replicate(group, replicas)
        return snap

    def _replicate(self, group: GroupMembers, copies: int) -> None:
        """A copy of each rank's state on each of its `buddy_nodes`."""
        self.homes = [group.describe(r).node_id or "?" for r in range(len(self.refs))]
        self.replica_nodes = buddy_nodes(self.homes, _alive_nodes(), copies)
        self.replicas = []
        for ref, nodes in zip(self.refs, self.replica_nodes, strict=True):
            mine = []
            for node in nodes:
                strategy = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
                done, copy = _copy.options(scheduling_strategy=strategy).remote(ref)
                self.copied.append(done)
                mine.append(copy)
            self.replicas.append(mine)

    def pending(self) -> list[ObjectRef]:
        """What storing this snapshot whole still waits for: the ranks' hand-overs not
        yet waited for, and the copies onto other nodes (`stored_whole`)."""
        return [*self.handed, *self.copied]

    def wait_stored(self, group: GroupMembers, timeout_s: float | None = None) -> None:
        """Until every rank's state is in the object store; SnapshotLostError when a
        rank died before it got there."""
        for rank, ref in enumerate(self.handed):
            try:
                ray.get(ref, timeout=timeout_s)  # the rank may have been replaced since
            except (ray.exceptions.RayActorError, *LOST_ERRORS) as err:
                raise SnapshotLostError(
                    f"{group.name}: rank {rank} was lost while its step snapshot was being "
                    f"stored ({type(err).__name__})"
                ) from err
        self.handed = []
        self._wait_copied(timeout_s)

    def _wait_copied(self, timeout_s: float | None) -> None:
        """Until every replica is stored; a copy that failed (its buddy node or the
        state was lost first) is only warned of: the primary stands."""
        for done in self.copied:
            try:
                ray.get(done, timeout=timeout_s)
            except (ray.exceptions.RayError, *LOST_ERRORS) as err:
                logger.warning(
                    "%s: a copy of a step snapshot on another node failed (%s); that rank "
                    "has fewer copies until the next step",
                    self.group,
                    type(err).__name__,
                )
        self.copied = []

    @staticmethod
    def nbytes(group: GroupMembers, timeout_s: float | None = None) -> int:
        """What a snapshot of `group` would hold: the sum of its ranks' `snapshot_nbytes()`."""
        return sum(GroupSnapshot.rank_nbytes(group, timeout_s))

    @staticmethod
    def rank_nbytes(group: GroupMembers, timeout_s: float | None = None) -> list[int]:
        """Each rank's `snapshot_nbytes()`: what its snapshot puts in its node's store."""
        refs = [
            group.actor_handle(r, "snapshot size")._rayrl_snapshot_nbytes.remote()
            for r in range(group.world_size)
        ]
        return list(_future(group, refs, "snapshot size").get(timeout_s))

    def restore(self, group: GroupMembers, timeout_s: float | None = None) -> dict[int, str]:
        """Every rank of `group` back to this snapshot (a replaced rank included), each
        from its first copy still there; returns the ranks restored from a replica, with
        the node it was on."""
        if group.world_size != len(self.refs):
            raise ValueError(
                f"{group.name} has {group.world_size} ranks; the snapshot has {len(self.refs)}"
            )
        self.wait_stored(group, timeout_s)
        if self.replicas:  # the rank fetches them itself: the first one still there
            copies = self._copies_by_node()
            refs = [
                group.actor_handle(r, "restore")._rayrl_restore_from.remote(
                    [ref for _, ref in copies[r]]
                )
                for r in range(group.world_size)
            ]
        else:
            refs = [
                group.actor_handle(r, "restore")._rayrl_restore.remote(self.refs[r])
                for r in range(group.world_size)
            ]
        try:
            used = _future(group, refs, "restore").get(timeout_s)
        except WorkerCallError as err:
            if isinstance(err.cause, LOST_ERRORS) or _lost(err.cause):
                what = "and its copies are" if self.replicas else "is"
                raise SnapshotLostError(
                    f"{group.name}: the snapshot of rank {err.rank} {what} gone "
                    f"({type(err.cause).__name__}: the node that held it was lost)"
                ) from err
            raise
        if not self.replicas:
            return {}
        taken = {r: copies[r][i][0] for r, i in enumerate(used)}
        return {r: node for r, node in taken.items() if node != self.homes[r]}

    def _copies_by_node(self) -> list[list[tuple[str, ObjectRef]]]:
        """Each rank's (node, copy) pairs: the primary and its replicas, those on nodes
        still alive first (a lost node's object is not waited for)."""
        alive = set(_alive_nodes())
        out = []
        for rank, primary in enumerate(self.refs):
            pairs = [(self.homes[rank], primary)]
            pairs += list(zip(self.replica_nodes[rank], self.replicas[rank], strict=True))
            out.append(sorted(pairs, key=lambda pair: pair[0] not in alive))
        return out


def stored_whole(pending: list[ObjectRef]) -> bool:
    """Wait for `pending` (`GroupSnapshot.pending`); whether every hand-over and copy
    got into its object store (a rank or node lost first: False)."""
    try:
        ray.get(pending)
    except (ray.exceptions.RayError, *LOST_ERRORS):
        return False
    return True


def _alive_nodes() -> list[str]:
    return [str(node["NodeID"]) for node in ray.nodes() if node.get("Alive")]


def _future(group: GroupMembers, refs: list[ObjectRef], stage: str) -> GroupFuture:
    return GroupFuture(
        refs,
        list(range(group.world_size)),
        collect_list,
        stage=stage,
        describe=group.describe,
        on_error=group._note_error,
        watchdog=group.watchdog,
    )


def _lost(cause: Any) -> bool:
    """Whether a task failed because an argument object was lost (Ray may wrap it)."""
    inner = getattr(cause, "cause", None)
    return (
        isinstance(inner, LOST_ERRORS)
        or "ObjectLostError" in type(cause).__name__
        or ("lost" in str(cause).lower() and "object" in str(cause).lower())
    )
