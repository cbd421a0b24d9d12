"""PoolSpec: what a resource pool asks for (bundle shape, per-node counts, strategy).

A plain, validated description shared by the ResourceGuard (which checks that it fits)
and the ResourcePool (which reserves it). It holds no Ray objects.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
LIFETIMES = (None, "detached")


@dataclass
class PoolSpec:
    """A named set of identical bundles.

    `per_node` gives bundle counts per node: with STRICT_PACK, `[8, 8]` means two
    distinct nodes holding 8 bundles each (one placement group per node). With PACK,
    SPREAD and STRICT_SPREAD the pool is one placement group of `sum(per_node)` bundles
    and Ray chooses the nodes (STRICT_SPREAD: every bundle on its own node).

    `align_with` names another STRICT_PACK pool of the same check whose per-node groups
    this pool's follow: this pool's group i goes to the node of that pool's group i
    (both STRICT_PACK, with as many entries in `per_node`). A pool of helpers (one per
    node of a pool of workers, say) then sits on exactly the nodes of the workers it
    serves, in the same node order.

    `capacity_factor >= 1.0` adds `ceil(world_size * (factor - 1))` spare bundles, kept
    in their own SPREAD group, for worker replacement. `loader_workers`, when declared,
    says each worker really uses `loader_workers + 1` CPUs (data loader and tokenizer
    threads); the guard warns when that over-subscribes a node's CPUs.
    """

    name: str
    per_node: list[int]
    bundle: dict[str, float]
    strategy: str = "STRICT_PACK"
    capacity_factor: float = 1.0
    lifetime: str | None = None
    loader_workers: int | None = None
    align_with: str | None = None

    def __post_init__(self) -> None:
        self.per_node = [int(n) for n in self.per_node]
        self.bundle = {k: float(v) for k, v in self.bundle.items()}
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the bad field and the accepted values."""
        where = f"PoolSpec {self.name!r}"
        if not self.name or "/" in self.name:
            raise ValueError(f"{where}: name must be non-empty and contain no '/'")
        if not self.per_node or any(n <= 0 for n in self.per_node):
            raise ValueError(
                f"{where}: per_node must list positive bundle counts, e.g. [8, 8]; got {self.per_node}"
            )
        if not self.bundle or any(v < 0 for v in self.bundle.values()):
            raise ValueError(
                f"{where}: bundle must map resources to non-negative amounts, e.g. "
                f'{{"GPU": 1, "CPU": 2}}; got {self.bundle}'
            )
        if not any(v > 0 for v in self.bundle.values()):
            raise ValueError(
                f"{where}: bundle {self.bundle} asks for nothing; give it a GPU or CPU"
            )
        if self.strategy not in STRATEGIES:
            raise ValueError(f"{where}: strategy {self.strategy!r} is not one of {STRATEGIES}")
        if not self.capacity_factor >= 1.0:
            raise ValueError(
                f"{where}: capacity_factor must be >= 1.0 (1.0 = no spares); got {self.capacity_factor}"
            )
        aligned = self.align_with is not None
        if aligned and (self.strategy != "STRICT_PACK" or self.align_with in ("", self.name)):
            raise ValueError(
                f"{where}: align_with={self.align_with!r} needs strategy STRICT_PACK "
                f"(got {self.strategy}) and the name of another pool"
            )
        if self.lifetime not in LIFETIMES:
            raise ValueError(f"{where}: lifetime must be None or 'detached'; got {self.lifetime!r}")
        if self.loader_workers is not None and self.loader_workers < 0:
            raise ValueError(f"{where}: loader_workers must be >= 0; got {self.loader_workers}")

    @property
    def world_size(self) -> int:
        """Number of active bundles (one worker each)."""
        return sum(self.per_node)

    @property
    def num_spares(self) -> int:
        """Spare bundles reserved by the capacity factor: ceil(n * (factor - 1))."""
        # Round first so that float noise (10 * 0.1 = 1.0000000000000009) adds no spare.
        return math.ceil(round(self.world_size * (self.capacity_factor - 1.0), 9))

    @property
    def worker_cpus(self) -> float:
        """CPUs one worker really uses: the bundle's CPUs, or loader_workers + 1 if more."""
        cpus = self.bundle.get("CPU", 0.0)
        if self.loader_workers is not None:
            cpus = max(cpus, float(self.loader_workers + 1))
        return cpus

    def shape(self) -> str:
        """The bundle as short text, e.g. 'GPU 1, CPU 2'."""
        return ", ".join(f"{k} {format_amount(k, v)}" for k, v in self.bundle.items())


def format_amount(resource: str, value: float) -> str:
    """A resource amount for humans: bytes as GiB for memory, plain numbers otherwise."""
    if "memory" in resource:
        return f"{value / 2**30:.1f}GiB"
    return f"{value:g}"
