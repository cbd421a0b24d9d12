"""ResourcePool: a named set of bundles reserved as Ray placement groups.

`bootstrap()` runs the ResourceGuard, then reserves: with STRICT_PACK one placement
group per entry of `per_node`, each pinned to the node the guard chose (so a node's
bundles stay together and the same cluster gives the same placement); with PACK,
SPREAD or STRICT_SPREAD one group of `world_size` bundles. Spare bundles from the
capacity factor live in their own SPREAD group, so they can land on any node.

Active bundles come back in rank order: sorted by node id, then bundle index, so the
rank-to-node map survives a teardown and a new bootstrap. Groups are named
`rayrl/<run>/<pool>/<i>` and `rayrl/<run>/<pool>/spares`. A non-detached pool is
released by `teardown()`, at interpreter exit, and on SIGTERM of the driver (or a
SIGINT that would end it at once); previous signal handlers still run afterwards. A
detached pool outlives its driver; `ResourcePool.attach("<run>/<pool>")` hands it to
a new one.

`reserve_pools(specs, run)` checks all of a run's pools together, then reserves them
all, active groups of every pool before any spares; if one fails none stays held.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from rayrl.cluster.bundle import Bundle
from rayrl.cluster.guard import ResourcesBusy, Verdict, assess, check, describe
from rayrl.cluster.inspect import GroupInfo, record_attachment, snapshot
from rayrl.cluster.spec import PoolSpec

__all__ = ["ExtraRequest", "PoolSpec", "ResourcePool", "reserve_pools"]

log = logging.getLogger(__name__)

NODE_LABEL = "ray.io/node-id"
MIN_READY_WAIT_S = 10.0


@dataclass(frozen=True)
class ExtraRequest:
    """More bundles asked of the cluster (`ResourcePool.request_extra`): their
    placement group and name; ``ready`` resolves once it is placed."""

    pg: PlacementGroup
    name: str
    ready: Any  # an ObjectRef, one per request (a stable key to wait on)


class ResourcePool:
    """Bundles of one pool of one run, reserved as placement groups.

    >>> pool = ResourcePool(PoolSpec("rollout", [4, 4], {"GPU": 1, "CPU": 2}), run="exp1")
    >>> bundles = pool.bootstrap(timeout_s=60)   # rank order
    >>> pool.teardown()
    """

    def __init__(self, spec: PoolSpec, run: str) -> None:
        if not run or "/" in run:
            raise ValueError(f"run name must be non-empty and contain no '/'; got {run!r}")
        self.spec = spec
        self.run = run
        self.name = f"rayrl/{run}/{spec.name}"
        self._groups: list[PlacementGroup] = []
        # one group per node holding spares (so that a lost node's can be removed whole)
        self._spare_groups: list[PlacementGroup] = []
        self._bundles: list[Bundle] = []
        self._spares: list[Bundle] = []
        self._extras: list[PlacementGroup] = []  # placed after losses, when spares ran out
        self._extra_count = 0

    def __repr__(self) -> str:
        return f"ResourcePool({self.name!r}, world_size={self.spec.world_size}, spares={len(self._spares)})"

    @property
    def bundles(self) -> list[Bundle]:
        """Active bundles in rank order (empty before bootstrap and after teardown)."""
        return list(self._bundles)

    @property
    def spares(self) -> list[Bundle]:
        """Spare bundles not yet taken."""
        return list(self._spares)

    @property
    def reserved(self) -> bool:
        return bool(self._groups)

    def bootstrap(self, timeout_s: float = 60.0) -> list[Bundle]:
        """Check the fit, reserve, and return the active bundles in rank order.

        Waits at most `timeout_s` for held resources (ResourcesBusy after that;
        ResourcesUnsatisfiable at once if the cluster can never hold the pool), then at
        most max(time left, min(timeout_s, 10 s)) for the groups to be placed.
        Returns the current bundles if the pool is already reserved. To reserve
        several pools of a run, use `reserve_pools`, which checks them together.
        """
        if self._groups:
            return self.bundles
        start = time.monotonic()
        verdict = check([self.spec], timeout_s)
        deadline = _placement_deadline(start, timeout_s)
        self._reserve_active(verdict, deadline)
        self._reserve_spares(deadline)
        return self._finish()

    def _reserve_active(self, verdict: Verdict, deadline: float) -> None:
        """Create the active groups (pinned where the guard placed them) and wait."""
        groups = self._create_active(verdict)
        self._await_ready(groups, [], deadline)
        self._groups = groups

    def _reserve_spares(self, deadline: float) -> None:
        """Create the spare groups once active groups are placed, so a spare can never
        take a slot a pinned group needs. Ray spreads them where there is room (one
        SPREAD group); that group is then re-made as one group per node, pinned where
        Ray put its bundles, so that a lost node's spares go with it whole
        (`release_lost`) instead of keeping Ray busy placing them again."""
        if not self.spec.num_spares:
            return
        spread = self._new_group("spares", self.spec.num_spares, "SPREAD", self._groups)
        self._await_ready([spread], self._groups, deadline)
        counts: dict[str, int] = {}
        for node in ray.util.placement_group_table(spread)["bundles_to_node_id"].values():
            counts[node] = counts.get(node, 0) + 1
        _remove_all([spread])
        groups: list[PlacementGroup] = []
        for i, (node, count) in enumerate(sorted(counts.items())):
            made = self._groups + groups
            groups.append(self._new_group(f"spares{i}", count, "STRICT_PACK", made, node))
        self._await_ready(groups, self._groups, deadline)
        self._spare_groups = groups

    def _finish(self) -> list[Bundle]:
        self._bundles = sorted(self._read(self._groups, spare=False), key=_rank_key)
        self._spares = sorted(self._read(self._spare_groups, spare=True), key=_rank_key)
        if self.spec.lifetime != "detached":
            _register(self)
        log.info(
            "pool %s reserved %d bundles (%d spares) on nodes %s",
            self.name,
            len(self._bundles),
            len(self._spares),
            sorted({b.node_id[:8] for b in self._bundles}),
        )
        return self.bundles

    @classmethod
    def attach(cls, name: str) -> ResourcePool:
        """Hand a detached pool reserved by an earlier driver to this one.

        `name` is "<run>/<pool>" (or the full "rayrl/<run>/<pool>"). The spec is read
        back from the placement groups; spares taken by the earlier driver count as
        spares again. Records this driver as a user of the run, so `rayrl doctor`
        does not call its groups stale while it lives. `teardown()` releases them.
        """
        full = name if name.startswith("rayrl/") else f"rayrl/{name}"
        parts = full.split("/")
        state = snapshot()
        found = (
            [g for g in state.groups if g.name.startswith(full + "/")] if len(parts) == 3 else []
        )
        active = sorted(
            (g for g in found if g.name.rsplit("/", 1)[1].isdigit()),
            key=lambda g: int(g.name.rsplit("/", 1)[1]),
        )
        if not active:
            known = sorted({g.name.rsplit("/", 1)[0] for g in state.groups if g.is_rayrl})
            raise RuntimeError(
                f"no detached pool {full!r} on this cluster (its placement groups "
                f"{full}/<i> are not there); pools found: {known or 'none'}. Pass "
                "'<run>/<pool>' as the earlier driver named them."
            )
        spares = [g for g in found if g.name.rsplit("/", 1)[1].startswith("spares")]
        pool = cls(_spec_of(parts[2], active, spares), parts[1])
        pool._groups = [_handle(g) for g in active]
        pool._spare_groups = [_handle(g) for g in spares]
        pool._bundles = sorted(pool._read(pool._groups, spare=False), key=_rank_key)
        pool._spares = sorted(pool._read(pool._spare_groups, spare=True), key=_rank_key)
        record_attachment(pool.run)
        log.info("attached to pool %s: %d bundles", pool.name, len(pool._bundles))
        return pool

    def _create_active(self, verdict: Verdict) -> list[PlacementGroup]:
        spec = self.spec
        if spec.strategy != "STRICT_PACK":
            return [self._new_group("0", spec.world_size, spec.strategy, [])]
        made: list[PlacementGroup] = []
        nodes = verdict.nodes_for(spec.name)
        for i, (count, node) in enumerate(zip(spec.per_node, nodes, strict=True)):
            made.append(self._new_group(str(i), count, "STRICT_PACK", made, node))
        return made

    def _new_group(
        self,
        suffix: str,
        count: int,
        strategy: str,
        made: list[PlacementGroup],
        node: str | None = None,
    ) -> PlacementGroup:
        """Create group `<pool name>/<suffix>` of `count` bundles, pinned to `node` if given.

        On failure the groups already `made` are removed before the error propagates.
        """
        name = f"{self.name}/{suffix}"
        try:
            return placement_group(
                [self.spec.bundle] * count,
                strategy=strategy,
                name=name,
                lifetime=self.spec.lifetime,
                bundle_label_selector=[{NODE_LABEL: node}] * count if node else None,
            )
        except Exception as err:
            _remove_all(made)
            if "already exists" in str(err):
                raise RuntimeError(
                    f"placement group {name!r} already exists in this Ray namespace: pool "
                    f"{self.name!r} is already reserved (call teardown() first), or a detached "
                    f"one was left behind: ResourcePool.attach({self.run + '/' + self.spec.name!r}) "
                    "takes it over, `rayrl doctor --cleanup` removes stale ones"
                ) from err
            raise

    def _await_ready(
        self, groups: list[PlacementGroup], placed: list[PlacementGroup], deadline: float
    ) -> None:
        """Wait until `groups` are placed; at the deadline remove them and `placed`, and raise."""
        refs = [g.ready() for g in groups]
        wait_s = max(0.0, deadline - time.monotonic())
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
        if len(ready) == len(refs):
            return
        _remove_all(placed + groups)
        cluster = snapshot()
        cluster.groups = [g for g in cluster.groups if not g.name.startswith(self.name + "/")]
        verdict = assess([self.spec], cluster)
        raise ResourcesBusy(
            f"placement groups of pool {self.name!r} were not placed in time "
            "(resources taken since the fit check, or a node went away); they were removed. "
            "Free the holders below or retry.",
            describe([self.spec], verdict, holders=True),
        )

    def _read(self, groups: list[PlacementGroup], spare: bool) -> list[Bundle]:
        out = []
        for pg in groups:
            table = ray.util.placement_group_table(pg)
            for index, node in sorted(table["bundles_to_node_id"].items()):
                out.append(
                    Bundle(
                        pg, int(index), node, dict(self.spec.bundle), pool=self.name, spare=spare
                    )
                )
        return out

    def take_spare(self, avoid_node: str | None = None) -> Bundle | None:
        """Hand out a spare bundle on a live node, preferring one not on `avoid_node`.

        Returns None when no spare is left (or none is on a live node).
        """
        alive = self.release_lost()
        for other in list(_LIVE.values()):  # the run's other pools lost groups there too
            if other is not self:
                other.release_lost()
        if not self._spares:
            return None
        for b in self._spares:
            b.node_id = ray.util.placement_group_table(b.pg)["bundles_to_node_id"].get(
                b.index, b.node_id
            )
        live = [b for b in self._spares if b.node_id in alive]
        choice = next((b for b in live if b.node_id != avoid_node), live[0] if live else None)
        if choice is None:
            log.warning("pool %s: no spare bundle is on a live node", self.name)
            return None
        self._spares.remove(choice)
        log.info(
            "pool %s: spare bundle %d on node %s taken", self.name, choice.index, choice.node_id[:8]
        )
        return choice

    def release_lost(self) -> set[str]:
        """Remove the pool's placement groups that have no bundle on a live node (a lost
        node's pinned groups, its spares, a bundle placed there after a loss): left
        behind, Ray keeps trying to place them again, and while they exist its GCS and
        dashboard agent use about a CPU core between them. Spares in them are dropped.
        A group with bundles on a live node as well stays. Returns the live node ids."""
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        lost = []
        for pg in self._groups + self._spare_groups + self._extras:
            try:
                nodes = set(ray.util.placement_group_table(pg)["bundles_to_node_id"].values())
            except Exception:  # noqa: BLE001 - already removed
                continue
            if nodes and not nodes & alive:
                lost.append(pg)
        if lost:
            _remove_all(lost)
            gone = {pg.id for pg in lost}
            self._groups = [g for g in self._groups if g.id not in gone]
            self._spare_groups = [g for g in self._spare_groups if g.id not in gone]
            self._extras = [g for g in self._extras if g.id not in gone]
            self._spares = [b for b in self._spares if b.pg.id not in gone]
            log.info("pool %s: removed %d placement group(s) of lost nodes", self.name, len(lost))
        return alive

    def reserve_extra(self, timeout_s: float = 30.0) -> Bundle | None:
        """A new bundle of the pool's shape, in a placement group of its own, wherever the
        cluster can place it (when no spare is left); None when it cannot within
        `timeout_s`. Released with the pool."""
        request = self.request_extra()
        ready, _ = ray.wait([request.ready], timeout=timeout_s)
        if not ready:
            self.cancel_extra(request)
            log.warning(
                "pool %s: no node could take a new bundle within %.0f s", self.name, timeout_s
            )
            return None
        return self.claim_extra(request)[0]

    def request_extra(self, count: int = 1) -> ExtraRequest:
        """Ask for ``count`` more bundles of the pool's shape, together on one node,
        placed wherever and whenever the cluster has room (a node joins, an autoscaler
        adds one), without waiting: `claim_extra` them once ``request.ready`` resolves,
        or `cancel_extra` the request."""
        name = f"{self.name}/extra{self._extra_count}"
        self._extra_count += 1
        pg = placement_group(
            [dict(self.spec.bundle)] * count,
            strategy="STRICT_PACK" if count > 1 else "PACK",
            name=name,
            lifetime=self.spec.lifetime,
        )
        self._extras.append(pg)
        return ExtraRequest(pg, name, pg.ready())

    def claim_extra(self, request: ExtraRequest) -> list[Bundle]:
        """The bundles of a placed `request_extra`, in index order (released with the
        pool, or by `release_extra`)."""
        nodes = ray.util.placement_group_table(request.pg)["bundles_to_node_id"]
        log.info("pool %s: new bundle(s) %s on node %s", self.name, request.name, nodes[0][:8])
        return [
            Bundle(request.pg, i, nodes[i], dict(self.spec.bundle), pool=self.name, spare=True)
            for i in sorted(nodes)
        ]

    def cancel_extra(self, request: ExtraRequest) -> None:
        """Withdraw a `request_extra` (placed or not)."""
        self._drop_extra(request.pg)

    def release_extra(self, bundle: Bundle) -> None:
        """Give back an extra bundle no worker uses any more (one of `claim_extra`'s);
        the pool's own bundles and spares stay."""
        if any(bundle.pg.id == pg.id for pg in self._extras):
            self._drop_extra(bundle.pg)

    def _drop_extra(self, pg: PlacementGroup) -> None:
        self._extras = [g for g in self._extras if g.id != pg.id]
        _remove_all([pg])

    def split(self, sizes: list[int]) -> list[list[Bundle]]:
        """Share the active bundles between roles: consecutive runs in rank order.

        `sizes` must be positive and add up to the world size, e.g. [4, 4] of 8.
        """
        if not self._bundles:
            raise RuntimeError(
                f"pool {self.name!r} is not reserved: call bootstrap() before split()"
            )
        if any(s <= 0 for s in sizes) or sum(sizes) != len(self._bundles):
            raise ValueError(
                f"pool {self.name!r}: split sizes {sizes} must be positive and add up to "
                f"its {len(self._bundles)} bundles"
            )
        out, start = [], 0
        for size in sizes:
            out.append(self._bundles[start : start + size])
            start += size
        return out

    def teardown(self) -> None:
        """Release every placement group of the pool. Safe to call more than once."""
        _LIVE.pop(id(self), None)
        groups = self._groups + self._spare_groups + self._extras
        self._groups, self._spare_groups, self._bundles, self._spares = [], [], [], []
        self._extras = []
        if not groups:
            return
        if not ray.is_initialized():
            if self.spec.lifetime == "detached":
                log.warning(
                    "pool %s is detached but Ray is disconnected: its groups stay; "
                    "`rayrl doctor --cleanup` removes them once stale",
                    self.name,
                )
            return
        _remove_all(groups)
        log.info("pool %s released %d placement groups", self.name, len(groups))


def reserve_pools(specs: list[PoolSpec], run: str, timeout_s: float = 60.0) -> list[ResourcePool]:
    """Check all of a run's pools together, then reserve them (all or none).

    The fit check sees every pool at once, so no pool is held while another waits
    or can never fit; active groups of all pools are placed before any spares.
    Raises what `ResourcePool.bootstrap` raises, after releasing whatever it held.
    """
    pools = [ResourcePool(spec, run) for spec in specs]
    start = time.monotonic()
    verdict = check(specs, timeout_s)
    deadline = _placement_deadline(start, timeout_s)
    try:
        for pool in pools:
            pool._reserve_active(verdict, deadline)
        for pool in pools:
            pool._reserve_spares(deadline)
    except BaseException:
        for pool in pools:
            pool.teardown()
        raise
    for pool in pools:
        pool._finish()
    return pools


def _placement_deadline(start: float, timeout_s: float) -> float:
    wait_s = max(timeout_s - (time.monotonic() - start), min(timeout_s, MIN_READY_WAIT_S))
    return time.monotonic() + wait_s


def _spec_of(name: str, active: list[GroupInfo], spare_groups: list[GroupInfo]) -> PoolSpec:
    """The PoolSpec a detached pool was reserved with, read back from its groups."""
    strategy = active[0].strategy
    per_node = [len(g.bundles) for g in active]
    spares = sum(len(g.bundles) for g in spare_groups)
    return PoolSpec(
        name,
        per_node if strategy == "STRICT_PACK" else [sum(per_node)],
        dict(active[0].bundles[0]),
        strategy=strategy,
        capacity_factor=1.0 + spares / sum(per_node),
        lifetime="detached",
    )


def _handle(group: GroupInfo) -> PlacementGroup:
    return PlacementGroup(ray.PlacementGroupID(bytes.fromhex(group.group_id)))


def _rank_key(b: Bundle) -> tuple[str, str, int]:
    return (b.node_id, b.pg.id.hex(), b.index)


def _remove_all(groups: list[PlacementGroup]) -> None:
    for pg in groups:
        try:
            remove_placement_group(pg)
        except Exception as err:  # already gone, or Ray is shutting down
            log.debug("removing placement group %s: %s", pg.id.hex(), err)


# Release of non-detached pools at exit and on SIGINT/SIGTERM. ----------------------
#
# SIGTERM releases the pools, then runs the handler that was there before. SIGINT
# (Ctrl-C) releases nothing when the previous handler is Python's (KeyboardInterrupt):
# the program's own `except KeyboardInterrupt` / `finally` runs first (an emergency
# checkpoint needs the workers) and the pools go at exit. Where the previous handler
# would end the process (SIG_DFL, or None: installed from C), they are released first
# and the signal is delivered again with the default action: never swallowed. An
# ignored signal (SIG_IGN) stays ignored. A handler that re-enters ours (a chain that
# loops back, e.g. after ray.init wrapped ours) ends the chain instead of recursing.

_LIVE: dict[int, ResourcePool] = {}
_PREVIOUS: dict[int, Any] = {}
_HANDLING: set[int] = set()
_ATEXIT = False


def _register(pool: ResourcePool) -> None:
    global _ATEXIT
    _LIVE[id(pool)] = pool
    if not _ATEXIT:
        atexit.register(_teardown_all, "interpreter exit")
        _ATEXIT = True
    if threading.current_thread() is threading.main_thread():
        _install_signal_handlers()


def _install_signal_handlers() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        current = signal.getsignal(sig)
        if current is _on_signal or current is signal.SIG_IGN:
            continue
        _PREVIOUS[sig] = current  # ray.init may have replaced ours: chain again
        signal.signal(sig, _on_signal)


def _teardown_all(reason: str) -> None:
    for pool in list(_LIVE.values()):
        log.info("releasing pool %s (%s)", pool.name, reason)
        pool.teardown()


def _on_signal(signum: int, frame: Any) -> None:
    previous = _PREVIOUS.get(signum, signal.SIG_DFL)
    if signum in _HANDLING:  # a chain that came back to us: end it here
        previous = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
    python_interrupt = signum == signal.SIGINT and callable(previous)
    if not python_interrupt:
        _teardown_all(f"signal {signal.Signals(signum).name}")
    _HANDLING.add(signum)
    try:
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:  # SIG_DFL, or None (a handler installed from C)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
    finally:
        _HANDLING.discard(signum)
