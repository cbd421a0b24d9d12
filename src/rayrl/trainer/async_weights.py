"""The collective weight transport of asynchronous training
(`async_training.weight_transport=collective`): which broadcast group a publish uses.

Actor rank 0 is member 0 of the group; the live replicas, in the rollout manager's
order, are members 1, 2, ... A publish reuses the last formation while the members
are the same and its last use went through; a replica lost or added, or a broadcast
that failed, makes the next publish form a new generation (`BroadcastHost.form`), so
the members of the old group drop it when they join the new one. The backend follows
the replicas' bundles: NCCL when they hold GPUs, gloo otherwise.

`CollectiveWeights` also counts what went through the group and how many times a
replica took a version from the object store because it missed its broadcast
(`async/weight_broadcast_bytes`, `async/weight_transport_fallbacks`: one a replica
and version; a failed send of actor rank 0 is not counted by itself).
"""

from __future__ import annotations

from dataclasses import dataclass

from rayrl.cluster.broadcast import BroadcastHost, BroadcastSpec
from rayrl.config.schema import RayRLConfig

__all__ = ["CollectiveWeights", "weight_sync_timeout"]

DEFAULT_TIMEOUT_S = 300.0


def weight_sync_timeout(cfg: RayRLConfig) -> float:
    """The bound on forming the group and on each broadcast: `async_training.
    weight_sync_timeout_s`, else `trainer.stage_timeout_s`, else 300 s."""
    a, t = cfg.async_training, cfg.trainer
    if a.weight_sync_timeout_s is not None:
        return float(a.weight_sync_timeout_s)
    return float(t.stage_timeout_s) if t.stage_timeout_s is not None else DEFAULT_TIMEOUT_S


@dataclass
class Plan:
    """One collective publish: the group, the store key of its header, and the rank of
    each replica (by name)."""

    group: BroadcastSpec
    key: str
    ranks: dict[str, int]


class CollectiveWeights:
    """The broadcast groups of one run's publishes (module docstring)."""

    def __init__(self, run: str, gpus: bool, timeout_s: float) -> None:
        self.name = f"rayrl/{run}/weights"
        self.backend = "nccl" if gpus else "gloo"
        self.timeout_s = timeout_s
        self.host: BroadcastHost | None = None
        self.spec: BroadcastSpec | None = None
        self.members: tuple[str, ...] = ()
        self.sender: int | None = None  # the sending group's generation it formed with
        self.stale = True  # the next publish forms a new generation
        self.publishes = 0
        self.fallbacks = 0  # since the last metrics
        self.broadcast_bytes = 0  # received by replicas over the group, likewise

    def plan(self, replicas: list[str], sender: int = 0) -> Plan | None:
        """The group for a publish to `replicas` (None when there are none) from actor
        rank 0 of the training group's generation `sender`: a new formation when the
        members changed, or the sender did (a replaced rank 0 cannot join the formation
        its predecessor joined: the others hold the dead process's address)."""
        if not replicas:
            return None
        if self.host is None:
            self.host = BroadcastHost(self.name)
        if self.stale or tuple(replicas) != self.members or sender != self.sender:
            self.spec = self.host.form(len(replicas) + 1, self.backend, self.timeout_s)
            self.members, self.stale, self.sender = tuple(replicas), False, sender
        assert self.spec is not None  # formed above while stale, as it is at first
        self.publishes += 1
        ranks = {name: rank for rank, name in enumerate(replicas, start=1)}
        return Plan(self.spec, f"publish{self.publishes}", ranks)

    def failed(self) -> None:
        """A replica missed a broadcast (it takes that version from the object store):
        count it, one for that replica, and form a new group next time."""
        self.fallbacks += 1
        self.stale = True

    def abandon(self, replica: str) -> bool:
        """`replica` is gone: if it is a member of the current formation, end every wait
        on it now (the sender and the other members fail within a moment, and the
        version goes by the object store) and form a new group next time. True if it
        was a member."""
        if self.spec is None or replica not in self.members:
            return False
        assert self.host is not None  # it formed the spec
        self.host.abandon(self.spec)
        self.stale = True
        return True

    def sender_lost(self) -> None:
        """Actor rank 0's publish died (its process, or the training group's): the
        replicas waiting for its broadcast stop waiting now, and the next publish forms
        a new group."""
        if self.spec is not None:
            assert self.host is not None  # it formed the spec
            self.host.abandon(self.spec)
        self.stale = True

    def send_failed(self) -> None:
        """Actor rank 0's send failed: form a new group next time. Not counted here:
        each replica that missed the version is counted by its own `failed`, and one
        that had received it all before the sender failed took nothing else."""
        self.stale = True

    def metrics(self) -> dict[str, float]:
        """`async/weight_transport_fallbacks` and `async/weight_broadcast_bytes` since
        the last call."""
        out = {
            "async/weight_transport_fallbacks": float(self.fallbacks),
            "async/weight_broadcast_bytes": float(self.broadcast_bytes),
        }
        self.fallbacks = self.broadcast_bytes = 0
        return out
