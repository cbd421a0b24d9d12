"""How a training world's ranks split: FSDP sharding groups (flat or hybrid) and Ulysses
sequence-parallel groups; plain arithmetic, no torch.

* **Sharding** (`MeshSpec.fsdp_size`, verl's ``fsdp_config.fsdp_size``): parameters,
  gradients and optimizer state are sharded over groups of ``fsdp_size`` consecutive
  ranks and replicated across those groups (HSDP: ``[replicate, shard]``, a 2-D mesh).
  With ranks placed node by node, ``fsdp_size`` = GPUs per node keeps every per-layer
  all-gather and reduce-scatter inside a node; only the gradient all-reduce of the
  replicas crosses nodes, once per mini-batch. ``-1`` (or the world size, or more, as
  in verl) is flat FSDP over every rank (a 1-D mesh).
* **Data** (`MeshSpec.sp`, verl's ``ulysses_sequence_parallel_size``): ``sp``
  consecutive ranks form one sequence-parallel group that holds the same rows and
  splits each packed row's tokens between them; the ``world / sp`` groups are the
  data-parallel ranks (``dp_rank``, ``dp_size``).
* **Experts** (`MeshSpec.ep`, ``actor.expert_parallel_size``, the reference's
  ``ref.expert_parallel_size``): a mixture-of-experts
  model's experts are split over groups of ``ep`` consecutive ranks, each holding
  ``experts / ep`` of them (`rayrl.train.expert_parallel`); the rows are split as
  without it (each rank is still its own data-parallel rank). The ranks that hold the
  same experts (every ``ep``-th) shard those experts' weights between them.

Sharding does not depend on the data split: every rank holds a shard of the same model,
SP ranks included. The config's validation, ``rayrl plan`` and the training engine's
device meshes (`rayrl.train.mesh`) all read their layout from `MeshSpec`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["EP_KEY", "MeshError", "MeshSpec", "check_experts", "check_heads"]

EP_KEY = "actor_rollout_ref.actor.expert_parallel_size"


class MeshError(ValueError):
    """A layout the world, the model or the config cannot have; the message says which key."""


@dataclass(frozen=True)
class MeshSpec:
    """How ``world`` ranks split into sharding groups and sequence-parallel groups.

    Args:
        world: ranks of the process group.
        sp: Ulysses sequence-parallel size (1: off); must divide ``world``.
        fsdp_size: ranks per sharding group; -1 (or ``world`` or more, as in verl)
            shards over all of them, a divisor of ``world`` below it replicates across
            ``world / fsdp_size`` groups.
        ep: expert-parallel size (1: off); must divide ``world``; not yet with ``sp``
            or hybrid sharding.
        ep_key: the config key ``ep`` came from, for the errors (the actor's by default;
            the reference's is ``actor_rollout_ref.ref.expert_parallel_size``).
    """

    world: int
    sp: int = 1
    fsdp_size: int = -1
    ep: int = 1
    ep_key: str = field(default=EP_KEY, compare=False)

    def __post_init__(self) -> None:
        if self.world < 1:
            raise MeshError(f"the world has {self.world} ranks; it needs at least one")
        if self.sp < 1 or self.world % self.sp:
            raise MeshError(
                f"ulysses_sequence_parallel_size={self.sp} must be at least 1 and divide the "
                f"{self.world} ranks (trainer.nnodes x trainer.n_gpus_per_node); pick a divisor "
                f"of {self.world}"
            )
        if self.fsdp_size == 0 or self.fsdp_size < -1:
            raise MeshError(
                f"fsdp_config.fsdp_size={self.fsdp_size}: use -1 (shard over every rank) or a "
                f"number of ranks per sharding group"
            )
        if 0 < self.fsdp_size < self.world and self.world % self.fsdp_size:
            raise MeshError(
                f"fsdp_config.fsdp_size={self.fsdp_size} must divide the {self.world} ranks "
                f"(e.g. the GPUs per node, to shard within a node and replicate across nodes), "
                "or be -1 (or at least the world size) to shard over all of them"
            )
        self._check_ep()

    def _check_ep(self) -> None:
        if self.ep < 1 or self.world % self.ep:
            raise MeshError(
                f"{self.ep_key}={self.ep} must be at least 1 and divide the {self.world} "
                f"data-parallel ranks; pick a divisor of {self.world}"
            )
        if self.ep > 1 and (self.sp > 1 or self.hybrid):
            raise MeshError(
                f"{self.ep_key}={self.ep} does not run with Ulysses sequence parallelism or "
                "hybrid sharding yet; set ulysses_sequence_parallel_size=1 and "
                "fsdp_config.fsdp_size=-1, or expert_parallel_size=1"
            )

    @property
    def edp(self) -> int:
        """Ranks that hold the same experts (and shard their weights between them)."""
        return self.world // self.ep

    @property
    def shard(self) -> int:
        """Ranks per sharding group."""
        return self.world if self.fsdp_size == -1 else min(self.fsdp_size, self.world)

    @property
    def replicate(self) -> int:
        """Sharding groups (replicas of the sharded state)."""
        return self.world // self.shard

    @property
    def hybrid(self) -> bool:
        """Sharded within groups and replicated across them (HSDP)."""
        return self.replicate > 1

    @property
    def dp(self) -> int:
        """Data-parallel ranks: groups of ``sp`` ranks that hold the same rows."""
        return self.world // self.sp

    def dp_rank(self, rank: int) -> int:
        return rank // self.sp

    def sp_rank(self, rank: int) -> int:
        return rank % self.sp

    def sp_ranks(self, rank: int) -> list[int]:
        """The ranks of ``rank``'s sequence-parallel group."""
        first = self.dp_rank(rank) * self.sp
        return list(range(first, first + self.sp))

    def describe(self) -> str:
        """One line: the sharding mesh and the data split."""
        if self.world == 1:
            fsdp = "one rank, nothing sharded"
        elif self.hybrid:
            fsdp = (
                f"HSDP, shard {self.shard} x replicate {self.replicate} (each group of "
                f"{self.shard} consecutive ranks shards the model; {self.replicate} groups "
                "replicate it)"
            )
        else:
            fsdp = f"FSDP, shard {self.shard} (every rank holds 1/{self.shard})"
        data = f"data parallel {self.dp} x Ulysses SP {self.sp}"
        experts = f"; expert parallel {self.ep}" if self.ep > 1 else ""
        return f"{self.world} rank(s): {fsdp}; {data}{experts}"


def check_heads(num_heads: int, num_kv_heads: int, sp: int, where: str = "") -> None:
    """MeshError unless Ulysses can split the attention heads over ``sp`` ranks: the query
    heads must divide by ``sp``, and the KV heads divide by it or divide it (then each is
    repeated to ``sp``)."""
    if sp <= 1:
        return
    at = f" ({where})" if where else ""
    if num_heads % sp:
        raise MeshError(
            f"ulysses_sequence_parallel_size={sp}{at} must divide the model's "
            f"{num_heads} attention heads; pick a divisor of {num_heads}"
        )
    if num_kv_heads % sp and sp % num_kv_heads:
        raise MeshError(
            f"ulysses_sequence_parallel_size={sp}{at} and the model's {num_kv_heads} key/value "
            f"heads: one must divide the other"
        )


def check_experts(num_experts: int | None, ep: int, where: str = "", key: str = EP_KEY) -> None:
    """MeshError, naming ``key``, unless ``ep`` ranks can split the model's
    ``num_experts`` experts (None: not a mixture-of-experts model)."""
    if ep <= 1:
        return
    at = f" ({where})" if where else ""
    if not num_experts:
        raise MeshError(
            f"{key}={ep}{at}: the model is not a mixture of experts (its config names "
            "no experts); set expert_parallel_size=1"
        )
    if num_experts % ep:
        raise MeshError(
            f"{key}={ep}{at} must divide the model's {num_experts} experts; pick a "
            f"divisor of {num_experts}"
        )
