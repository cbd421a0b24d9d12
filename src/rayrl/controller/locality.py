"""Rows that stay on their node: splitting a call's rows over a second group's ranks the
way a first group holds them, node by node.

A DP_SPLIT call cuts its rows into equal contiguous chunks, one per data-parallel part
of the group, in part order (padding the last ones). When a second group with workers
on the same nodes (a pool placed with `PoolSpec.align_with`) is called with the same
rows, an even split over its own ranks sends rows across nodes as soon as the two
groups differ in size. `rows_by_node` says instead how many rows each rank of the
second group takes, contiguous in rank order: the rows the first group's parts on
node k hold go to the second group's ranks on node k, evenly among them. `split_rows`
cuts a Batch so (pre-split `Chunks` for a DP_SPLIT method, whose results concatenate
back in rank order, so the rows keep their order). Where the two groups' nodes do not
line up (a rank moved to another node after a loss), `rows_by_node` gives None and
the caller splits evenly: every row is still processed once, only not on its node.
A rank may get no rows (fewer rows than ranks on a node).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rayrl.controller.dispatch import Chunks

if TYPE_CHECKING:
    from rayrl.controller.group import WorkerGroup


def part_rows(n_rows: int, parts: int) -> list[int]:
    """The real rows (padding left out) DP_SPLIT gives each of `parts` parts: chunks of
    ceil(n_rows / parts), the last ones short or empty."""
    size = -(-n_rows // parts)
    return [max(0, min(size, n_rows - part * size)) for part in range(parts)]


def part_nodes(group: WorkerGroup, layout: str | None = None) -> list[str]:
    """The node of each data-parallel part of `group` (a WorkerGroup) for calls that
    follow data layout `layout` (the node of each part's first rank); every rank is
    its own part without one."""
    nodes = [bundle.node_id for bundle in group.bundles]
    found = group.data_layout(layout)
    return [nodes[rank] for rank in found.leaders] if found is not None else nodes


def _runs(nodes: Sequence[str], counts: Sequence[int]) -> list[tuple[str, int]]:
    """Consecutive entries on the same node merged: (node, their total)."""
    runs: list[tuple[str, int]] = []
    for node, count in zip(nodes, counts, strict=True):
        if runs and runs[-1][0] == node:
            runs[-1] = (node, runs[-1][1] + count)
        else:
            runs.append((node, count))
    return runs


def even_rows(n_rows: int, ranks: int) -> list[int]:
    """`n_rows` over `ranks` ranks in contiguous runs whose sizes differ by at most one,
    larger ones first (as `Batch.chunk`)."""
    q, r = divmod(n_rows, ranks)
    return [q + (1 if i < r else 0) for i in range(ranks)]


def rows_by_node(
    n_rows: int, source_nodes: Sequence[str], target_nodes: Sequence[str]
) -> list[int] | None:
    """Rows per target rank such that the rows a DP_SPLIT over `source_nodes` (the node
    of each source part, in part order) gives to the parts on a node go to the target
    ranks on that node (`target_nodes`: each rank's node, in rank order), evenly among
    them; None when the two groups' nodes, run by run, are not the same sequence."""
    source = _runs(source_nodes, part_rows(n_rows, len(source_nodes)))
    target = _runs(target_nodes, [1] * len(target_nodes))
    if [node for node, _ in source] != [node for node, _ in target]:
        return None
    sizes: list[int] = []
    for (_, rows), (_, ranks) in zip(source, target, strict=True):
        sizes += even_rows(rows, ranks)
    return sizes


def split_rows(batch: Any, sizes: Sequence[int]) -> Chunks:
    """`batch` cut into contiguous runs of `sizes` rows (views), one per rank, as the
    pre-split argument of a DP_SPLIT call."""
    if sum(sizes) != len(batch) or any(size < 0 for size in sizes):
        raise ValueError(f"split_rows: sizes {list(sizes)} do not add up to {len(batch)} rows")
    parts, start = [], 0
    for size in sizes:
        parts.append(batch[start : start + size])
        start += size
    return Chunks(parts)
