"""Which ranks of a group share the rows of a DP_SPLIT call.

By default every rank is its own data-parallel part: DP_SPLIT gives each rank a chunk
and concatenates every rank's output. Ranks that run one computation together need
the same rows instead: the ranks of a sequence-parallel group (they split each row's
tokens among themselves), or the ranks of a tensor-parallel rollout replica (they
split the model). A `DataLayout` says which part each rank takes; the call then splits
the rows into one chunk per part, sends every rank its part's chunk, and collects the
output of each part's first rank only (its `leaders`).

A worker method names the layout it follows (`@register(dispatch=DP_SPLIT,
layout="train")`); the group holds the layouts by name (`WorkerGroup.data_layouts`),
set by whoever knows them (the trainer, from what its workers report after init).
A method whose layout the group does not hold splits over every rank as usual.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DataLayout:
    """Rank `r` takes part `part_of[r]` of a call's rows; parts are numbered 0..P-1."""

    part_of: tuple[int, ...]

    def __post_init__(self) -> None:
        parts = sorted(set(self.part_of))
        if parts != list(range(len(parts))):
            raise ValueError(
                f"a data layout numbers its parts 0..P-1, each held by some rank; got "
                f"{list(self.part_of)}"
            )

    @classmethod
    def grouped(cls, world_size: int, group_size: int) -> DataLayout:
        """Consecutive ranks in groups of `group_size` share a part."""
        if group_size < 1 or world_size % group_size:
            raise ValueError(f"groups of {group_size} ranks do not divide {world_size} ranks")
        return cls(tuple(rank // group_size for rank in range(world_size)))

    @property
    def parts(self) -> int:
        return max(self.part_of) + 1 if self.part_of else 0

    @property
    def leaders(self) -> list[int]:
        """The first rank of every part, in part order: where its output is taken from."""
        return [self.part_of.index(part) for part in range(self.parts)]

    @property
    def trivial(self) -> bool:
        """Every rank is its own part (what DP_SPLIT does without a layout)."""
        return self.part_of == tuple(range(len(self.part_of)))
