"""Fit: place the demand of resource pools onto nodes (pure bin packing, no Ray).

A pool's demand is a list of `Unit`s, each one or more identical bundles that must
share a node; units with the same `distinct` key must land on different nodes; a unit
that `align`s with another pool shares the node of that pool's unit of the same index
(the search places the two as one, their needs added). `pack`
searches for an assignment of every unit to a node whose resources hold it (exact,
iterative depth-first search with a step budget), trying nodes in sorted order so the same
cluster always gives the same answer: that is what keeps ranks on the same nodes
across a teardown and a new bootstrap.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rayrl.cluster.spec import PoolSpec

EPS = 1e-6
DEFAULT_BUDGET = 200_000


@dataclass(frozen=True)
class Unit:
    """Bundles that must share one node.

    `kind` is "node" (a STRICT_PACK per-node group), "bundle" (one bundle of a
    PACK/SPREAD/STRICT_SPREAD group) or "spare"; `index` counts within that kind.
    `align` names the pool whose "node" unit of the same index this one must share a
    node with (`PoolSpec.align_with`).
    """

    pool: str
    kind: str
    index: int
    count: int
    shape: tuple[tuple[str, float], ...]
    distinct: str | None = None
    align: str | None = None

    @property
    def need(self) -> dict[str, float]:
        """Resources the whole unit needs on its node."""
        return {k: v * self.count for k, v in self.shape if v > 0}


@dataclass
class PackResult:
    """An assignment (node id per unit, in the units' order) or None; `exhausted` is
    True when the search stopped at its step budget instead of proving no fit."""

    assignment: list[str] | None
    exhausted: bool = False

    @property
    def fits(self) -> bool:
        return self.assignment is not None


def pool_units(spec: PoolSpec) -> list[Unit]:
    """The units a pool needs: its active groups or bundles, then its spares."""
    shape = tuple(sorted(spec.bundle.items()))
    units: list[Unit] = []
    if spec.strategy == "STRICT_PACK":
        for i, count in enumerate(spec.per_node):
            units.append(
                Unit(spec.name, "node", i, count, shape, distinct=spec.name, align=spec.align_with)
            )
    else:
        distinct = spec.name if spec.strategy == "STRICT_SPREAD" else None
        for i in range(spec.world_size):
            units.append(Unit(spec.name, "bundle", i, 1, shape, distinct=distinct))
    for i in range(spec.num_spares):
        units.append(Unit(spec.name, "spare", i, 1, shape))
    return units


def anchors(units: Sequence[Unit]) -> dict[int, int]:
    """For each aligned unit (by position in `units`), the position of the unit it shares
    a node with: its `align` pool's "node" unit of the same index. ValueError when that
    pool or unit is not among `units`."""
    where = {(u.pool, u.kind, u.index): i for i, u in enumerate(units)}
    out: dict[int, int] = {}
    for i, unit in enumerate(units):
        if unit.align is None:
            continue
        anchor = where.get((unit.align, "node", unit.index))
        if anchor is None or units[anchor].align is not None:
            have = sum(1 for u in units if u.pool == unit.align and u.kind == "node")
            raise ValueError(
                f"pool {unit.pool!r} aligns its per-node group {unit.index} with pool "
                f"{unit.align!r}, which has {have} per-node group(s) in this check (and must "
                "align with none itself): check both pools together, STRICT_PACK, with as "
                "many entries in per_node"
            )
        out[i] = anchor
    return out


def holds(have: Mapping[str, float], need: Mapping[str, float]) -> bool:
    """Whether `have` covers every positive amount in `need`."""
    return all(have.get(k, 0.0) + EPS >= v for k, v in need.items() if v > 0)


def aggregate_shortfall(
    units: Sequence[Unit], nodes: Mapping[str, Mapping[str, float]]
) -> str | None:
    """A quick necessary check: the cluster's sums and node count. None if it passes."""
    totals: dict[str, float] = {}
    for unit in units:
        for k, v in unit.need.items():
            totals[k] = totals.get(k, 0.0) + v
    for k, v in totals.items():
        have = sum(n.get(k, 0.0) for n in nodes.values())
        if have + EPS < v:
            return f"the pools need {k} {v:g} in all and the nodes have {have:g}"
    counts: dict[str, int] = {}
    for unit in units:
        if unit.distinct:
            counts[unit.distinct] = counts.get(unit.distinct, 0) + 1
    for key, n in counts.items():
        if n > len(nodes):
            return f"pool {key!r} needs {n} distinct nodes and the cluster has {len(nodes)}"
    return None


def pack(
    units: Sequence[Unit],
    nodes: Mapping[str, Mapping[str, float]],
    budget: int = DEFAULT_BUDGET,
) -> PackResult:
    """Assign every unit to a node with room for it, honouring `distinct` keys and
    alignments (an aligned unit goes where its anchor goes, their needs added).

    Larger units are placed first; nodes are tried in sorted id order; identical
    units are placed in non-decreasing node order (strictly increasing when they
    must be distinct) so the search does not revisit symmetric assignments. The
    depth-first search keeps its own stack (one entry per placed unit), so tens of
    thousands of units need no recursion.
    """
    if not units:
        return PackResult([])
    if aggregate_shortfall(units, nodes):
        return PackResult(None)
    search = _Search(units, nodes)
    if search.run(budget):
        return PackResult([search.node_ids[j] for j in search.chosen])
    return PackResult(None, exhausted=search.steps > budget)


class _Search:
    """The state of one depth-first search: free resources, choices, used nodes."""

    def __init__(self, units: Sequence[Unit], nodes: Mapping[str, Mapping[str, float]]) -> None:
        self.units = units
        self.node_ids = sorted(nodes)
        self.free = [dict(nodes[n]) for n in self.node_ids]
        self.riders = anchors(units)  # placed with their anchor, as one unit
        self.needs = [dict(units[i].need) for i in range(len(units))]
        for rider, anchor in self.riders.items():
            _take(self.needs[anchor], self.needs[rider], +1)
        placed = [i for i in range(len(units)) if i not in self.riders]
        self.order = sorted(placed, key=lambda i: _size_key(units[i], self.needs[i]))
        self.chosen: list[int] = [-1] * len(units)
        self.used: set[tuple[str, int]] = set()
        self.steps = 0

    def first_node(self, pos: int) -> int:
        """The lowest node index unit `order[pos]` may take (symmetry breaking)."""
        if pos == 0:
            return 0
        i, prev = self.order[pos], self.order[pos - 1]
        unit = self.units[i]
        if not _same(unit, self.units[prev]) or self.needs[i] != self.needs[prev]:
            return 0
        return self.chosen[prev] + (1 if unit.distinct is not None else 0)

    def try_from(self, pos: int, start: int, budget: int) -> int:
        """Place unit `order[pos]` on the first node >= start with room; -1 if none."""
        i = self.order[pos]
        unit, need = self.units[i], self.needs[i]
        for j in range(start, len(self.node_ids)):
            self.steps += 1
            if self.steps > budget:
                return -1
            if unit.distinct and (unit.distinct, j) in self.used:
                continue
            if holds(self.free[j], need):
                _take(self.free[j], need, -1)
                if unit.distinct:
                    self.used.add((unit.distinct, j))
                self.chosen[i] = j
                return j
        return -1

    def undo(self, pos: int) -> int:
        """Take unit `order[pos]` off its node; returns that node's index."""
        i = self.order[pos]
        j, unit = self.chosen[i], self.units[i]
        _take(self.free[j], self.needs[i], +1)
        if unit.distinct:
            self.used.discard((unit.distinct, j))
        return j

    def run(self, budget: int) -> bool:
        """Place every unit, backtracking on dead ends; False if none fits or budget ran out."""
        pos, start = 0, 0
        while pos < len(self.order):
            if self.try_from(pos, start, budget) >= 0:
                pos += 1
                start = self.first_node(pos) if pos < len(self.order) else 0
                continue
            if pos == 0 or self.steps > budget:
                return False
            pos -= 1
            start = self.undo(pos) + 1
        for rider, anchor in self.riders.items():
            self.chosen[rider] = self.chosen[anchor]
        return True


def _size_key(unit: Unit, need: Mapping[str, float]) -> tuple[float | str | int, ...]:
    rest = sum(v for k, v in need.items() if k not in ("GPU", "CPU") and "memory" not in k)
    return (-need.get("GPU", 0.0), -need.get("CPU", 0.0), -rest, unit.pool, unit.kind, unit.index)


def _same(a: Unit, b: Unit) -> bool:
    return a.shape == b.shape and a.count == b.count and a.distinct == b.distinct


def _take(free: dict[str, float], need: Mapping[str, float], sign: int) -> None:
    for k, v in need.items():
        free[k] = free.get(k, 0.0) + sign * v
