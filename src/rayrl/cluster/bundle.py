"""Bundle: one reserved slot of a placement group, the unit a worker is placed on."""

from __future__ import annotations

from dataclasses import dataclass, field

from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


@dataclass
class Bundle:
    """A reserved bundle: its placement group, index in that group, node and shape.

    `pool` names the ResourcePool it belongs to; `spare` marks capacity-factor bundles
    kept free for worker replacement.
    """

    pg: PlacementGroup
    index: int
    node_id: str
    resources: dict[str, float] = field(default_factory=dict)
    pool: str = ""
    spare: bool = False

    def scheduling_strategy(self) -> PlacementGroupSchedulingStrategy:
        """The Ray scheduling strategy that places an actor on exactly this bundle."""
        return PlacementGroupSchedulingStrategy(
            placement_group=self.pg,
            placement_group_bundle_index=self.index,
            placement_group_capture_child_tasks=True,
        )

    @property
    def num_gpus(self) -> float:
        return float(self.resources.get("GPU", 0))

    @property
    def num_cpus(self) -> float:
        return float(self.resources.get("CPU", 0))
