"""Tensor-parallel rollout: replicas of TP ranks over the worker group, and their collectives.

The rollout's ranks are the actor's: the worker group forms one torch.distributed
world over them (`rayrl.controller.formation`), and the TP groups are cut from it.
With ``tp = actor_rollout_ref.rollout.tensor_model_parallel_size`` and ``W`` ranks,
ranks ``[i * tp, (i + 1) * tp)`` form replica ``i`` (``W / tp`` replicas; consecutive
ranks, so a replica stays on one node when ``tp`` divides the GPUs per node). Each
replica is one model split over its ranks; its rank ``j`` holds the ``j``-th shard
(`rayrl.rollout.native.shards`).

Running a replica (what the worker and the controller do):

- every rank of the world calls `make_tp_groups` once, in the same order, after the
  world is formed (again after the world is re-formed: groups of an older world are
  dead), and builds its engine with ``**groups.engine_options``;
- the prompts of a step split into ``W / tp`` chunks, one per replica (`ReplicaLayout`);
  every rank of replica ``i`` gets chunk ``i``, the same rows in the same order, with
  the same sampling parameters, seed and step (the sample keys come from them), and
  calls ``generate`` at the same time; weight updates, ``sleep`` and ``wake`` are
  called on every rank too;
- every rank of a replica returns the same output; take it from the replica's first
  rank (`ReplicaLayout.leaders`) and drop the others'.

Multi-turn episodes on a replica (`rayrl.rollout.native.tp_turns`): the tools
and environments run once, on TP rank 0; their answers reach the other ranks by
broadcast before the scheduler applies them, so every rank appends the same tokens at
the same step.

The ranks of a replica run in lockstep without a coordinator: each runs the same
deterministic scheduler on the same inputs, and every sampled token is decided from
collectives whose result is the same on every rank, so each rank makes the same
scheduling decision at every step. `generate` checks that the inputs agree (one small
all-gather per call) and fails with a clear error when they do not, rather than hang.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from rayrl.rollout.native.shards import KEY, TPShard
from rayrl.rollout.native.spec import ModelSpec

__all__ = [
    "ReplicaLayout",
    "TPGroups",
    "TensorParallel",
    "call_fingerprint",
    "digest",
    "make_tp_groups",
    "tensor_parallel_for",
]


@dataclass(frozen=True)
class ReplicaLayout:
    """How ``world_size`` rollout ranks form replicas of ``tp_size`` ranks each."""

    world_size: int
    tp_size: int

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.world_size % self.tp_size:
            raise ValueError(
                f"{KEY}={self.tp_size} must be at least 1 and divide the rollout's "
                f"{self.world_size} ranks (trainer.nnodes * trainer.n_gpus_per_node); pick a "
                "divisor, e.g. the GPUs of one node."
            )

    @property
    def replicas(self) -> int:
        return self.world_size // self.tp_size

    def ranks(self, replica: int) -> list[int]:
        """The ranks of ``replica``, its TP rank 0 first."""
        return list(range(replica * self.tp_size, (replica + 1) * self.tp_size))

    def replica_of(self, rank: int) -> int:
        return rank // self.tp_size

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp_size

    @property
    def leaders(self) -> list[int]:
        """The first rank of every replica: where a replica's output is taken from."""
        return [r * self.tp_size for r in range(self.replicas)]


@dataclass(frozen=True)
class TPGroups:
    """This rank's replica and its TP process group (None when ``tp_size`` is 1)."""

    layout: ReplicaLayout
    rank: int
    group: dist.ProcessGroup | None

    @property
    def replica(self) -> int:
        return self.layout.replica_of(self.rank)

    @property
    def tp_rank(self) -> int:
        return self.layout.tp_rank(self.rank)

    @property
    def engine_options(self) -> dict:
        """``NativeRolloutEngine`` arguments of this rank: ``tp_size`` and ``tp_group``."""
        return {"tp_size": self.layout.tp_size, "tp_group": self.group}


def make_tp_groups(world_size: int, tp_size: int) -> TPGroups:
    """Cut the TP groups from the formed torch.distributed world; every rank calls it.

    Every rank creates every group (``torch.distributed.new_group`` is collective over
    the world, so all ranks must call it, in the same order) and keeps its own. With
    ``tp_size`` 1 no group is created and nothing is communicated.

    Raises:
        ValueError: ``tp_size`` does not divide ``world_size``.
        RuntimeError: torch.distributed is not initialised or has another world size.
    """
    layout = ReplicaLayout(world_size, tp_size)
    if tp_size == 1:
        rank = dist.get_rank() if dist.is_initialized() else 0
        return TPGroups(layout, rank, None)
    if not dist.is_initialized() or dist.get_world_size() != world_size:
        found = dist.get_world_size() if dist.is_initialized() else "no"
        raise RuntimeError(
            f"make_tp_groups: {KEY}={tp_size} needs the rollout ranks' torch.distributed "
            f"world of {world_size} ranks, found {found} world; form the worker group's "
            "process group first."
        )
    rank, mine = dist.get_rank(), None
    for replica in range(layout.replicas):
        ranks = layout.ranks(replica)
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return TPGroups(layout, rank, mine)


class TensorParallel:
    """This rank's shard of the model and the collectives of its TP group."""

    def __init__(self, spec: ModelSpec, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.shard = TPShard(spec, self.size, self.rank)
        self.device = torch.device(device)

    def all_reduce(self, x: Tensor, op=dist.ReduceOp.SUM) -> Tensor:
        """Sum (or ``op``) ``x`` over the group, in place; returns it."""
        dist.all_reduce(x, op=op, group=self.group)
        return x

    def all_gather(self, x: Tensor) -> Tensor:
        """``[size, *x.shape]``: every rank's ``x``, in rank order."""
        out = torch.empty(self.size * x.numel(), dtype=x.dtype, device=x.device)
        _all_gather_single(out, x.contiguous().view(-1), group=self.group)
        return out.view(self.size, *x.shape)

    def broadcast_count(self, count: int) -> int:
        """TP rank 0's ``count`` on every rank (``count`` is ignored elsewhere)."""
        box = torch.tensor([count], dtype=torch.int64, device=self.device)
        dist.broadcast(box, group=self.group, group_src=0)
        return int(box.item())

    def broadcast_object(self, obj):
        """TP rank 0's picklable ``obj`` on every rank (``obj`` is ignored elsewhere)."""
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, group=self.group, group_src=0, device=self.device)
        return box[0]

    def agree(self, value: int, what: str) -> None:
        """Raise RuntimeError unless every rank of the group passes the same ``value``."""
        mine = torch.tensor([value], dtype=torch.int64, device=self.device)
        values = self.all_gather(mine).view(-1).tolist()
        if len(set(values)) > 1:
            odd = [r for r, v in enumerate(values) if v != values[0]]
            raise RuntimeError(
                f"native rollout engine (TP rank {self.rank} of {self.size}): the TP ranks "
                f"{odd} got other {what} than TP rank 0. Every rank of a replica must get the "
                "same prompts, in the same order, with the same sampling parameters, seed and "
                "step (rayrl.rollout.native.tp)."
            )


_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def tensor_parallel_for(
    spec: ModelSpec, tp_size: int, tp_group, device, where: str
) -> TensorParallel | None:
    """This rank's `TensorParallel` (None for one rank: no collective is ever issued);
    ``where`` names the engine in errors."""
    if tp_group is None:
        if tp_size != 1:
            raise ValueError(
                f"{where}: tp_size={tp_size} needs tp_group=, this rank's replica group "
                "from rayrl.rollout.native.tp.make_tp_groups."
            )
        return None
    size = dist.get_world_size(tp_group)
    if size != tp_size:
        raise ValueError(f"{where}: tp_size={tp_size} but tp_group has {size} ranks.")
    return TensorParallel(spec, tp_group, device) if size > 1 else None


def call_fingerprint(
    prompts: list[np.ndarray], keys: np.ndarray, limits: np.ndarray, sampling
) -> int:
    """A 64-bit digest of a generate call's inputs (the TP ranks must agree on them)."""
    lengths = np.asarray([len(p) for p in prompts], dtype=np.int64)
    parts = [repr(sampling).encode(), lengths.tobytes(), *(p.tobytes() for p in prompts)]
    return digest(*parts, keys.tobytes(), limits.tobytes())


def digest(*parts: bytes) -> int:
    digest = hashlib.blake2b(digest_size=8)
    for part in parts:
        digest.update(part)
    return int.from_bytes(digest.digest(), "little", signed=True)
