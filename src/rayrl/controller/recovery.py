"""Step-boundary snapshots of a group, owned by the driver, and putting them back.

    snap = GroupSnapshot.take(group)      # every rank's `snapshot_state()`
    ...                                   # a rank dies; group.replace(rank) re-forms
    snap.restore(group)                   # every rank back to the snapshot, new ones too
    nxt = GroupSnapshot.take(group, previous=snap)   # the next boundary's

Each rank returns its state as the result of a call, so the object sits in the object
store of the rank's node (host RAM, not the worker's heap) and is owned by the driver,
not by the worker: it outlives the worker's death, and a replaced rank gets its own
part (its shard, when sharded) back. Only the loss of the node that holds it takes it
away; `restore` then raises SnapshotLostError and the caller falls back to the last
checkpoint. A rank that dies while a snapshot is taken or restored raises
WorkerCallError, as any group call does.

Taking one has two phases. Every rank captures its state into host memory (the
driver waits: the state must be copied before the next update changes it), then
hands it over on a thread of its own (`Worker._rayrl_snapshot_publish`) while the next
calls run: Ray's copy into the object store (gigabytes for a GPU model's weights and
Adam moments) overlaps the next step's generation instead of adding to the step.
The next `take` (``previous``) and `restore` wait for the hand-over first; a rank
that died before finishing it left no snapshot (SnapshotLostError).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray import ObjectRef

from rayrl.controller.dispatch import collect_list
from rayrl.controller.errors import WorkerCallError
from rayrl.controller.future import GroupFuture

LOST_ERRORS = (ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError)


class SnapshotLostError(RuntimeError):
    """A rank's snapshot object is gone (the node holding it was lost)."""


@dataclass
class GroupSnapshot:
    """One ObjectRef per rank of a group's state, and what taking it cost."""

    group: str
    refs: list[ObjectRef]
    seconds: float
    handed: list[ObjectRef] = field(default_factory=list)  # the ranks' hand-overs done

    @classmethod
    def take(
        cls, group: Any, timeout_s: float | None = None, previous: GroupSnapshot | None = None
    ) -> GroupSnapshot:
        """Every rank's `snapshot_state()`, captured (waited for) and handed to the
        object store in the background; ``previous`` (the last snapshot of `group`)
        is waited for first, its time counted in ``seconds``."""
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
        return cls(
            group.name,
            [state for _, state in calls],
            time.perf_counter() - start,
            [done for done, _ in calls],
        )

    def wait_stored(self, group: Any, timeout_s: float | None = None) -> None:
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

    @staticmethod
    def nbytes(group: Any, timeout_s: float | None = None) -> int:
        """What a snapshot of `group` would hold: the sum of its ranks' `snapshot_nbytes()`."""
        return sum(GroupSnapshot.rank_nbytes(group, timeout_s))

    @staticmethod
    def rank_nbytes(group: Any, timeout_s: float | None = None) -> list[int]:
        """Each rank's `snapshot_nbytes()`: what its snapshot puts in its node's store."""
        refs = [
            group.actor_handle(r, "snapshot size")._rayrl_snapshot_nbytes.remote()
            for r in range(group.world_size)
        ]
        return list(_future(group, refs, "snapshot size").get(timeout_s))

    def restore(self, group: Any, timeout_s: float | None = None) -> None:
        """Every rank of `group` back to this snapshot (a replaced rank included)."""
        if group.world_size != len(self.refs):
            raise ValueError(
                f"{group.name} has {group.world_size} ranks; the snapshot has {len(self.refs)}"
            )
        self.wait_stored(group, timeout_s)
        refs = [
            group.actor_handle(r, "restore")._rayrl_restore.remote(self.refs[r])
            for r in range(group.world_size)
        ]
        try:
            _future(group, refs, "restore").get(timeout_s)
        except WorkerCallError as err:
            if isinstance(err.cause, LOST_ERRORS) or _lost(err.cause):
                raise SnapshotLostError(
                    f"{group.name}: the snapshot of rank {err.rank} is gone "
                    f"({type(err.cause).__name__}: the node that held it was lost)"
                ) from err
            raise


def _future(group: Any, refs: list[ObjectRef], stage: str) -> GroupFuture:
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
