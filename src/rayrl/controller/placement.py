"""Where a replaced rank goes: its own bundle when usable, else a spare, else a new one.

A bundle is usable while its node is alive and its placement group is placed. When
it is not (the node died), the rank takes a spare bundle of the pool (reserved by
`capacity_factor > 1`), preferably on another node, and when none is left a new
bundle wherever the cluster can place one (`ResourcePool.reserve_extra`). The rank
then runs elsewhere, which changes the collectives' topology (which ranks share a
node): `topology_message` says what changed, in the words of the
TopologyChangedWarning.
"""

from __future__ import annotations

from typing import cast

import ray

from rayrl.cluster.bundle import Bundle
from rayrl.controller.errors import NoSpareBundleError
from rayrl.controller.group_core import GroupCore


def alive_nodes() -> set[str]:
    """Node ids Ray currently considers alive."""
    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


def bundle_usable(bundle: Bundle) -> bool:
    """Whether a new actor can start in `bundle`: its node is alive and its group placed.

    After a node dies Ray tries to reschedule the group's bundles from that node; until
    that succeeds (never, for a group pinned to the dead node) the group is not CREATED.
    """
    if bundle.node_id not in alive_nodes():
        return False
    try:
        table = ray.util.placement_group_table(bundle.pg)
    except Exception:  # noqa: BLE001 - a removed group is not usable
        return False
    usable = (
        table.get("state") == "CREATED"
        and table["bundles_to_node_id"].get(bundle.index) == bundle.node_id
    )
    return cast(bool, usable)


def pick_bundle(group: GroupCore, rank: int) -> bool:
    """Keep rank's bundle if it is usable; else give rank a spare of the pool, else a new
    bundle wherever the cluster can place one. Returns whether the rank moved bundle."""
    bundle = group.bundles[rank]
    if bundle_usable(bundle):
        return False
    pool = group.pool
    spare = pool.take_spare(avoid_node=bundle.node_id) if pool is not None else None
    if spare is None and pool is not None:
        spare = pool.reserve_extra(timeout_s=group.placement_timeout_s)
    if spare is None:
        name = getattr(pool, "name", None) or bundle.pool or "?"
        raise NoSpareBundleError(
            f"{group.name}: rank {rank}'s bundle on node {bundle.node_id} is gone (node dead or "
            f"its placement group unplaced), pool '{name}' has no spare bundle left on a live "
            f"node and no node could take a new one within {group.placement_timeout_s:.0f} s. "
            "Reserve spares with resources.capacity_factor > 1 (e.g. 1.25) and pass pool= to "
            "the GroupCore, or add a node and recreate the group."
        )
    group.bundles[rank] = spare
    return True


def topology_message(group: GroupCore, rank: int, old_node: str, new_node: str) -> str:
    """What moving `rank` did: the nodes, and which ranks now share which node."""
    nodes: dict[str, list[int]] = {}
    for r, bundle in enumerate(group.bundles):
        nodes.setdefault(bundle.node_id, []).append(r)
    layout = "; ".join(f"node {node}: ranks {ranks}" for node, ranks in sorted(nodes.items()))
    collectives = (
        f"the {group.backend} process group re-formed as generation {group.generation} "
        "over this placement (local ranks renumbered"
        + (", more traffic inside one node)" if len(nodes[new_node]) > 1 else ")")
        if group.forms_process_group
        else "local ranks renumbered"
    )
    return (
        f"{group.name}: rank {rank} moved from node {old_node} to node {new_node}: topology "
        f"changed. Ranks per node now {layout}; {collectives}"
    )
