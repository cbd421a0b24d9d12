"""ResourceGuard: check that resource pools fit the cluster before reserving them.

`assess` compares the demand of every pool (per-node groups for STRICT_PACK, distinct
nodes for STRICT_SPREAD, any node for PACK/SPREAD and spares) with each live node, and
gives one of four verdicts:

* fits   - the free resources hold it now: reserve;
* never  - even the nodes' totals cannot hold it, and no autoscaler can add nodes that
           would: `check` raises ResourcesUnsatisfiable at once, with the demand and
           per-node total/free tables;
* scale  - the current nodes cannot hold it but the cluster has an autoscaler (and the
           node types it may add, when it says which, could): `check` asks it for the
           bundles (`ray.autoscaler.sdk.request_resources`) and waits up to its timeout
           for nodes, saying what it requested, then raises ResourcesUnsatisfiable;
* busy   - it fits the totals but others hold resources: `check` waits up to its
           timeout, logging who holds what (placement groups, stale ones of finished
           jobs flagged, actors outside groups, and what tasks hold), then raises
           ResourcesBusy with those tables.

Check every pool of a run in one call (`check(all_pools)`, as `reserve_pools` does):
pools checked one by one could hold the first while the second waits or fails.

It also warns when the CPUs workers really use (`loader_workers + 1` each) exceed a
node's CPUs. `render_plan` shows all of this for `rayrl plan`.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from rayrl.cluster.fit import Unit, aggregate_shortfall, anchors, holds, pack, pool_units
from rayrl.cluster.inspect import ActorInfo, ClusterState, short_id, snapshot
from rayrl.cluster.spec import PoolSpec, format_amount
from rayrl.cluster.tables import (
    groups_table,
    holder_line,
    loose_holders_table,
    nodes_table,
    render_text,
    resource_names,
)

log = logging.getLogger(__name__)


class ResourceError(RuntimeError):
    """A pool cannot be reserved. `table` is the plain-text report behind the message."""

    def __init__(self, message: str, table: str) -> None:
        super().__init__(message)
        self.message = message
        self.table = table

    def __str__(self) -> str:
        return f"{self.message}\n{self.table}" if self.table else self.message


class ResourcesUnsatisfiable(ResourceError):
    """The pools can never fit this cluster, whatever is released."""


class ResourcesBusy(ResourceError):
    """The pools fit the cluster's totals, but the resources stayed held until the timeout."""


class CpuOversubscribed(UserWarning):
    """Workers on a node will use more CPUs than the node has."""


@dataclass
class Verdict:
    """The outcome of a fit check.

    `assignment` gives a node id per unit (in `units` order): against free resources
    when `status` is "fits", against totals when "busy", None when "never".
    """

    status: str
    units: list[Unit]
    assignment: list[str] | None
    reason: str
    cluster: ClusterState

    def nodes_for(self, pool: str, kind: str = "node") -> list[str]:
        """Node ids of one pool's units of `kind`, in unit index order."""
        if self.assignment is None:
            return []
        pairs = [
            (u.index, n)
            for u, n in zip(self.units, self.assignment, strict=True)
            if u.pool == pool and u.kind == kind
        ]
        return [n for _, n in sorted(pairs)]

    def per_node(self, pool: str, spares: bool = False) -> dict[str, int]:
        """How many of a pool's bundles land on each node (spares or active ones)."""
        counts: dict[str, int] = {}
        if self.assignment is None:
            return counts
        for unit, node in zip(self.units, self.assignment, strict=True):
            if unit.pool == pool and (unit.kind == "spare") == spares:
                counts[node] = counts.get(node, 0) + unit.count
        return counts


def demand(pools: Sequence[PoolSpec]) -> list[Unit]:
    """Every unit of every pool; pool names must be unique, and a pool that aligns with
    another (`PoolSpec.align_with`) must be checked with it."""
    names = [p.name for p in pools]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ValueError(f"pool names must be unique; repeated: {sorted(dup)}")
    units = [u for p in pools for u in pool_units(p)]
    anchors(units)  # raises when an aligned pool's partner is missing or differs
    for p in pools:
        partner = next((q for q in pools if q.name == p.align_with), None)
        if partner is not None and len(partner.per_node) != len(p.per_node):
            raise ValueError(
                f"pool {p.name!r} aligns with pool {p.align_with!r} node by node: both need "
                f"as many per-node groups; got {p.per_node} and {partner.per_node}"
            )
    return units


def assess(pools: Sequence[PoolSpec], cluster: ClusterState) -> Verdict:
    """Compare the pools' demand with the cluster's totals and free resources, no waiting.

    A demand the nodes' totals can never hold is "scale" rather than "never" when
    `cluster.autoscaler` is set and the node types it may add could hold it.
    """
    units = demand(pools)
    now = pack(units, cluster.free)
    if now.fits:
        return Verdict("fits", units, now.assignment, "fits the free resources now", cluster)
    ever = pack(units, cluster.totals)
    if ever.fits:
        return Verdict(
            "busy",
            units,
            ever.assignment,
            "fits the nodes' totals, but not what is free now",
            cluster,
        )
    if ever.exhausted or now.exhausted:
        reason = "the fit search gave up (too many nodes and groups to try); treating it as held"
        return Verdict("busy", units, None, reason, cluster)
    reason = _never_reason(pools, units, cluster)
    if cluster.autoscaler is not None:
        beyond = _beyond_autoscaler(units, cluster.autoscaler)
        if beyond is None:
            why = f"the current nodes cannot hold it ({reason}); the autoscaler may add nodes"
            return Verdict("scale", units, None, why, cluster)
        reason = f"{reason}; {beyond}"
    return Verdict("never", units, None, reason, cluster)


def _beyond_autoscaler(units: list[Unit], autoscaler: dict[str, Any]) -> str | None:
    """Why the nodes the autoscaler may add could not hold the demand; None if they could
    (or if it does not say which node types it has)."""
    types = [t for t in autoscaler.get("node_types", []) if t.get("max_count", 0) != 0]
    if not types:
        return None
    for unit in units:
        if not any(holds(t["resources"], unit.need) for t in types):
            return (
                f"no node type the autoscaler may add holds {unit.count} x {dict(unit.shape)} "
                f"of pool {unit.pool!r}"
            )
    limits = autoscaler.get("max_resources") or {}
    for k, v in _totals(units).items():
        if k in limits and limits[k] + 1e-6 < v:
            return (
                f"the autoscaler's max_resources allow {k} {limits[k]:g} and the pools need {v:g}"
            )
    return None


def _totals(units: Sequence[Unit]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for unit in units:
        for k, v in unit.need.items():
            totals[k] = totals.get(k, 0.0) + v
    return totals


def _never_reason(pools: Sequence[PoolSpec], units: list[Unit], cluster: ClusterState) -> str:
    spec = {p.name: p for p in pools}
    for unit in units:
        if not any(holds(n.total, unit.need) for n in cluster.nodes):
            return _unit_reason(spec[unit.pool], unit, cluster)
    for rider, anchor in anchors(units).items():
        need = dict(units[anchor].need)
        for k, v in units[rider].need.items():
            need[k] = need.get(k, 0.0) + v
        if not any(holds(n.total, need) for n in cluster.nodes):
            a, r = units[anchor], units[rider]
            return (
                f"pool {r.pool!r} follows pool {a.pool!r} node by node (align_with): "
                f"their per-node groups {a.index} need {a.count} x ({spec[a.pool].shape()}) "
                f"and {r.count} x ({spec[r.pool].shape()}) on one node, and no node has all "
                "of that. Ask for less per node or add larger nodes"
            )
    short = aggregate_shortfall(units, cluster.totals)
    if short:
        return f"{short}. Ask for fewer bundles or add nodes"
    return "the pools together do not fit the nodes' totals. Ask for fewer bundles or add nodes"


def _unit_reason(spec: PoolSpec, unit: Unit, cluster: ClusterState) -> str:
    """Why one unit fits no node: the resources it needs beyond the largest node."""
    need = unit.need
    most = {k: max((n.total.get(k, 0.0) for n in cluster.nodes), default=0.0) for k in need}
    short = [k for k in resource_names([need]) if k in need and most[k] + 1e-6 < need[k]]
    where = "on one node" if unit.count > 1 else "in one bundle"
    head = f"pool {unit.pool!r} ({spec.strategy}) needs {unit.count} x ({spec.shape()}) {where}"
    if not short:
        return f"{head}; no single node has all of that together. Ask for less per node or add larger nodes"
    needs = ", ".join(f"{k} {format_amount(k, need[k])}" for k in short)
    have = ", ".join(f"{k} {format_amount(k, most[k])}" for k in short)
    return (
        f"{head}, that is {needs}; the most any node has is {have}. Split it over more "
        "nodes (per_node), ask for less per bundle, or add larger nodes"
    )


def check(
    pools: Sequence[PoolSpec],
    timeout_s: float = 60.0,
    *,
    poll_s: float = 0.5,
    log_every_s: float = 10.0,
    autoscaler: dict[str, Any] | None | bool = True,
) -> Verdict:
    """Return a "fits" verdict, waiting at most `timeout_s` for held resources or for
    nodes an autoscaler adds.

    Raises ResourcesUnsatisfiable at once when the pools can never fit (and at the
    timeout when the autoscaler added no room), ResourcesBusy when they still do not
    fit after `timeout_s`. Warns (CpuOversubscribed) when workers' CPU use exceeds a
    node's CPUs. `autoscaler`: True to detect one from the GCS, None for none, or what
    `ray_private.autoscaler()` returns, to decide as if the cluster had that one.
    """
    names = ", ".join(repr(p.name) for p in pools)
    deadline = time.monotonic() + max(0.0, timeout_s)
    look = _looker(autoscaler)
    verdict = assess(pools, look())
    last_log: float | None = None
    requested = False
    try:
        while verdict.status != "fits":
            now = time.monotonic()
            _raise_if_hopeless(pools, names, verdict, now >= deadline, timeout_s)
            if verdict.status == "scale" and not requested:
                request_scale_up(verdict.units)
                requested = True
            if last_log is None or now - last_log >= log_every_s:
                log.warning(_waiting_message(names, verdict, deadline - now))
                last_log = now
            time.sleep(min(poll_s, max(0.0, deadline - now)))
            verdict = assess(pools, look())
    finally:
        if requested:
            request_scale_up([])
    for message in cpu_warnings(pools, verdict):
        log.warning(message)
        warnings.warn(message, CpuOversubscribed, stacklevel=2)
    return verdict


def _looker(autoscaler: dict[str, Any] | None | bool) -> Callable[[], ClusterState]:
    """A snapshot function that sets the cluster's autoscaler as `check` was told."""

    def look() -> ClusterState:
        state = snapshot()
        if autoscaler is not True:
            state.autoscaler = autoscaler or None
        return state

    return look


def _raise_if_hopeless(
    pools: Sequence[PoolSpec], names: str, verdict: Verdict, late: bool, timeout_s: float
) -> None:
    if verdict.status == "never":
        raise ResourcesUnsatisfiable(
            f"pools {names} can never fit this cluster: {verdict.reason}.",
            describe(pools, verdict, holders=False),
        )
    if late and verdict.status == "scale":
        raise ResourcesUnsatisfiable(
            f"pools {names} do not fit this cluster and the autoscaler added no room for "
            f"them within {timeout_s:g}s (asked for: {requested_text(verdict.units)}): "
            f"{verdict.reason}. Check the autoscaler's node types and limits "
            "(`ray status`), or raise resources.wait_timeout_s for a slow scale-up.",
            describe(pools, verdict, holders=False),
        )
    if late:
        raise ResourcesBusy(
            f"pools {names} {verdict.reason}; still held after waiting {timeout_s:g}s. "
            "Free the holders below (`rayrl doctor --cleanup` removes stale rayrl groups) "
            "or raise resources.wait_timeout_s.",
            describe(pools, verdict, holders=True),
        )


def request_scale_up(units: Sequence[Unit]) -> None:
    """Ask the autoscaler for room for `units` (one bundle per unit); [] withdraws it."""
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=[u.need for u in units])


def requested_text(units: Sequence[Unit]) -> str:
    """What a scale-up request asks for, e.g. '2 x {GPU 8, CPU 16}, 1 x {CPU 1}'."""
    counts: dict[str, int] = {}
    for unit in units:
        shape = ", ".join(f"{k} {format_amount(k, v)}" for k, v in sorted(unit.need.items()))
        counts["{" + shape + "}"] = counts.get("{" + shape + "}", 0) + 1
    return ", ".join(f"{n} x {shape}" for shape, n in counts.items())


def _waiting_message(names: str, verdict: Verdict, left_s: float) -> str:
    if verdict.status == "scale":
        return (
            f"pools {names}: {verdict.reason}; asked the autoscaler for "
            f"{requested_text(verdict.units)} and waiting up to {left_s:.0f}s for nodes."
        )
    cluster = verdict.cluster
    holders = [holder_line(g) for g in cluster.groups]
    holders += [loose_holder_line(a) for a in cluster.loose_actors()]
    holders += [
        f"tasks (or others the GCS does not name) hold {_shape(held)} on {short_id(node)}"
        for node, held in sorted(cluster.other_holders().items())
    ]
    return (
        f"pools {names} {verdict.reason}; waiting up to {left_s:.0f}s more. Held by:\n  "
        + "\n  ".join(holders or ["nothing the GCS shows"])
    )


def loose_holder_line(actor: ActorInfo) -> str:
    """One line naming an actor outside placement groups and what it holds."""
    name = actor.name or actor.actor_id[:12]
    return (
        f"actor {name} ({actor.class_name}, job {actor.job_id}) holds "
        f"{_shape(actor.resources)} on {short_id(actor.node_id)}"
    )


def _shape(held: dict[str, float]) -> str:
    return ", ".join(f"{k} {format_amount(k, v)}" for k, v in sorted(held.items()) if v)


def cpu_warnings(pools: Sequence[PoolSpec], verdict: Verdict) -> list[str]:
    """One message per node where workers' CPU use (loader_workers + 1 each) exceeds its CPUs."""
    use = _cpu_use(pools, verdict)
    out = []
    for node_id, (reserved, used) in sorted(use.items()):
        node = verdict.cluster.node(node_id)
        total = node.total.get("CPU", 0.0) if node else 0.0
        if used > total + 1e-6:
            out.append(
                f"CPU over-subscription on node {short_id(node_id)}: workers there use {used:g} CPUs "
                f"(loader_workers + 1 per worker where declared; {reserved:g} reserved) and the node "
                f"has {total:g}. "
                "Lower loader_workers or place fewer workers per node."
            )
    return out


def _cpu_use(pools: Sequence[PoolSpec], verdict: Verdict) -> dict[str, tuple[float, float]]:
    """Per node: (CPUs reserved by active bundles, CPUs their workers really use)."""
    spec = {p.name: p for p in pools}
    use: dict[str, tuple[float, float]] = {}
    if verdict.assignment is None:
        return use
    for unit, node in zip(verdict.units, verdict.assignment, strict=True):
        if unit.kind == "spare":
            continue
        p = spec[unit.pool]
        reserved, used = use.get(node, (0.0, 0.0))
        use[node] = (
            reserved + unit.count * p.bundle.get("CPU", 0.0),
            used + unit.count * p.worker_cpus,
        )
    return use


def demand_table(pools: Sequence[PoolSpec], verdict: Verdict | None = None) -> Table:
    """One row per pool: bundle shape, count, spares, strategy, and placement if known."""
    table = Table(title="Pools", title_justify="left")
    for col in ("pool", "bundle", "count", "spares", "strategy", "per node", "placement"):
        table.add_column(col)
    for p in pools:
        placement = "?"
        if verdict is not None and verdict.assignment is not None:
            active = verdict.per_node(p.name)
            spare = verdict.per_node(p.name, spares=True)
            placement = ", ".join(f"{short_id(n)}: {c}" for n, c in sorted(active.items()))
            if spare:
                placement += " | spares " + ", ".join(
                    f"{short_id(n)}: {c}" for n, c in sorted(spare.items())
                )
        table.add_row(
            escape(p.name),
            p.shape(),
            str(p.world_size),
            str(p.num_spares),
            p.strategy + (f" on {escape(p.align_with)}'s nodes" if p.align_with else ""),
            str(p.per_node),
            placement,
        )
    return table


def cpu_table(pools: Sequence[PoolSpec], verdict: Verdict) -> Table:
    """Per node: CPUs, CPUs reserved by the pools' bundles, CPUs their workers use."""
    table = Table(title="CPU budget (active workers)", title_justify="left")
    for col in ("node", "CPUs", "reserved", "workers use", "status"):
        table.add_column(col)
    use = _cpu_use(pools, verdict)
    for node in verdict.cluster.nodes:
        reserved, used = use.get(node.node_id, (0.0, 0.0))
        total = node.total.get("CPU", 0.0)
        status = "[red]OVER-SUBSCRIBED[/red]" if used > total + 1e-6 else "ok"
        table.add_row(node.short, f"{total:g}", f"{reserved:g}", f"{used:g}", status)
    return table


def describe(pools: Sequence[PoolSpec], verdict: Verdict, holders: bool = True) -> str:
    """The plain-text report used in error messages: pools, nodes, and holders."""
    names = resource_names(p.bundle for p in pools)
    parts: list[object] = [demand_table(pools, verdict), nodes_table(verdict.cluster, names)]
    if holders:
        parts.append(_holders(verdict.cluster))
    return render_text(*parts)


def _holders(cluster: ClusterState) -> object:
    parts: list[object] = []
    if cluster.groups:
        parts.append(groups_table(cluster.groups, title="Holders (placement groups)"))
    loose = loose_holders_table(cluster)
    if loose is not None:
        parts.append(loose)
    if not parts:
        return Text("Nothing the GCS shows holds resources (they may just have been freed).")
    return Group(*parts)


def render_plan(pools: Sequence[PoolSpec], cluster: ClusterState) -> Group:
    """What `rayrl plan` prints: pools and placement, nodes, CPU budget, and the verdict."""
    verdict = assess(pools, cluster)
    names = resource_names(p.bundle for p in pools)
    colour = {"fits": "green", "busy": "yellow", "scale": "yellow", "never": "red"}[verdict.status]
    parts: list[object] = [
        demand_table(pools, verdict),
        nodes_table(cluster, names),
    ]
    if verdict.assignment is not None:
        parts.append(cpu_table(pools, verdict))
    if verdict.status == "busy":
        parts.append(_holders(cluster))
    parts.append(Text(f"{verdict.status.upper()}: {verdict.reason}", style=f"bold {colour}"))
    for message in cpu_warnings(pools, verdict):
        parts.append(Text(f"WARNING: {message}", style="yellow"))
    return Group(*parts)
