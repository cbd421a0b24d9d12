"""Worker replacement: a dead worker gets a new actor, its init again, and the group re-forms.

`WorkerGroup.replace(rank)` lands here. Each new actor goes into its old bundle when
that bundle is still usable (node alive, placement group placed), otherwise into a
spare bundle of the pool: the rank then runs on another node, which is logged and
warned (TopologyChangedWarning with both node ids) and pushed to the other ranks as
their new local ranks. Finally every rank joins the process group of a new discovery
generation. Nothing here happens unless the controller asks: Ray never restarts a
worker on its own (`max_restarts=0`).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import ray

from rayrl.cluster.bundle import Bundle
from rayrl.controller.errors import NoSpareBundleError, WorkerInitError
from rayrl.controller.health import Replacement, TopologyChangedWarning

logger = logging.getLogger("rayrl.controller")


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
    return (
        table.get("state") == "CREATED"
        and table["bundles_to_node_id"].get(bundle.index) == bundle.node_id
    )


def replace_ranks(
    group: Any, ranks: list[int], timeout_s: float, retries: int
) -> list[Replacement]:
    """Replace `ranks` of `group` (see WorkerGroup.replace); one re-formation for all."""
    ranks = sorted(set(ranks))
    bad = [r for r in ranks if not 0 <= r < group.world_size]
    if not ranks or bad:
        raise IndexError(
            f"{group.name} has ranks 0..{group.world_size - 1}; cannot replace {bad or ranks}"
        )
    with group.replacing(ranks):  # health checks skip these ranks meanwhile
        return _replace(group, ranks, timeout_s, retries)


def _replace(group: Any, ranks: list[int], timeout_s: float, retries: int) -> list[Replacement]:
    old = {r: group.describe(r) for r in ranks}
    spare = {r: _pick_bundle(group, r) for r in ranks}
    failures = group._restart(ranks, timeout_s)
    # A node may have died after its bundle was judged usable: move those ranks now.
    late = [r for r in failures if not spare[r] and not bundle_usable(group.bundles[r])]
    if late:
        spare.update({r: _pick_bundle(group, r) for r in late})
        failures = {r: e for r, e in failures.items() if r not in late}
        failures.update(group._restart(late, timeout_s))
    attempt = 0
    while failures and attempt < retries:
        attempt += 1
        failures = group._restart(sorted(failures), timeout_s)
    if failures:
        group._raise(WorkerInitError, "replace", failures, timeout_s, attempts=attempt + 1)
    new = {r: group.describe(r) for r in ranks}
    group.dead.difference_update(ranks)
    moved = [r for r in ranks if new[r].node_id != old[r].node_id]
    for r in moved:
        message = (
            f"{group.name}: rank {r} moved from node {old[r].node_id} to node "
            f"{new[r].node_id}: topology changed"
        )
        logger.warning(message)
        warnings.warn(message, TopologyChangedWarning, stacklevel=3)
    if moved:
        _push_contexts(group, skip=set(ranks))
    if group.backend:
        group.generation += 1
        group._form_process_group()
    out = []
    for r in ranks:
        logger.warning(
            "%s: replaced rank %d (pid %s -> %s, node %s -> %s), generation %d",
            group.name, r, old[r].pid, new[r].pid, old[r].node_id, new[r].node_id, group.generation,
        )  # fmt: skip
        out.append(
            Replacement(
                r,
                old[r].node_id,
                new[r].node_id,
                old[r].pid,
                new[r].pid,
                group.generation,
                spare[r],
            )
        )
    return out


def _pick_bundle(group: Any, rank: int) -> bool:
    """Keep rank's bundle if it is usable; else give rank a spare. Returns whether a spare."""
    bundle = group.bundles[rank]
    if bundle_usable(bundle):
        return False
    pool = group.pool
    spare = pool.take_spare(avoid_node=bundle.node_id) if pool is not None else None
    if spare is None:
        name = getattr(pool, "name", None) or bundle.pool or "?"
        raise NoSpareBundleError(
            f"{group.name}: rank {rank}'s bundle on node {bundle.node_id} is gone (node dead or "
            f"its placement group unplaced) and pool '{name}' has no spare bundle left on a live "
            "node. Reserve spares with resources.capacity_factor > 1 (e.g. 1.25) and pass "
            "pool= to the WorkerGroup, or add a node and recreate the group."
        )
    group.bundles[rank] = spare
    return True


def _push_contexts(group: Any, skip: set[int]) -> None:
    """Tell the ranks that stayed their (possibly changed) local rank."""
    refs = [
        group.actors[r]._rayrl_set_context.remote(group._context(r))
        for r in range(group.world_size)
        if r not in skip
    ]
    ray.get(refs, timeout=group.dist_timeout_s)
