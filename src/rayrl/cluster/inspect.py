"""Cluster state: live nodes with total and free resources, placement groups with their
owners, detached actors, and the software versions on each node.

Everything here reads the GCS directly (through `rayrl.cluster.ray_private`), so it
works on clusters started without the dashboard. A placement group is *stale* when it
is detached, still alive, and the job that created it has finished, unless a live
driver re-attached to its run (`ResourcePool.attach`): nobody will ever release it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rayrl.cluster import ray_private

log = logging.getLogger(__name__)

RAYRL_PREFIX = "rayrl/"
VERSION_PACKAGES = ("ray", "torch", "transformers", "rayrl")


@dataclass
class NodeInfo:
    """A live node: id, address, and its total and currently free resources."""

    node_id: str
    address: str
    is_head: bool
    total: dict[str, float]
    free: dict[str, float]

    @property
    def short(self) -> str:
        return short_id(self.node_id)


@dataclass
class GroupInfo:
    """A placement group as the GCS records it, with its creator job's state."""

    group_id: str
    name: str
    state: str
    strategy: str
    job_id: str
    job_dead: bool
    detached: bool
    namespace: str
    bundles: list[dict[str, float]] = field(default_factory=list)
    bundle_nodes: list[str] = field(default_factory=list)

    @property
    def alive(self) -> bool:
        return self.state != "REMOVED"

    @property
    def stale(self) -> bool:
        """Detached, alive, and its creating job has finished."""
        return self.alive and self.detached and self.job_dead

    @property
    def is_rayrl(self) -> bool:
        return self.name.startswith(RAYRL_PREFIX)

    @property
    def run(self) -> str:
        """The rayrl run a group `rayrl/<run>/<pool>/<i>` belongs to ("" for others)."""
        return run_of(self.name)

    def held_per_node(self) -> dict[str, dict[str, float]]:
        """Resources this group reserves, per node id (unplaced bundles are left out)."""
        held: dict[str, dict[str, float]] = {}
        for shape, node in zip(self.bundles, self.bundle_nodes, strict=True):
            if not node:
                continue
            acc = held.setdefault(node, {})
            for k, v in shape.items():
                acc[k] = acc.get(k, 0.0) + v
        return held


@dataclass
class ActorInfo:
    """An actor as the GCS records it (only the fields the doctor needs)."""

    actor_id: str
    name: str
    namespace: str
    class_name: str
    state: str
    job_id: str
    job_dead: bool
    detached: bool
    group_id: str
    node_id: str = ""
    pid: int = 0
    resources: dict[str, float] = field(default_factory=dict)

    @property
    def run(self) -> str:
        """The rayrl run an actor `rayrl/<run>/...` belongs to ("" for others)."""
        return run_of(self.name)

    def is_rayrl(self, rayrl_groups: set[str]) -> bool:
        """Named `rayrl/...`, in a `rayrl` namespace, or placed in a rayrl group."""
        return (
            self.name.startswith(RAYRL_PREFIX)
            or self.namespace.startswith("rayrl")
            or self.group_id in rayrl_groups
        )


@dataclass
class ClusterState:
    """One snapshot: live nodes (sorted by id), placement groups that are not removed,
    job liveness by job id, actors, and the detached runs live drivers re-attached to
    (run -> their job ids)."""

    nodes: list[NodeInfo]
    groups: list[GroupInfo]
    jobs_dead: dict[str, bool]
    actors: list[ActorInfo] = field(default_factory=list)
    attached: dict[str, list[str]] = field(default_factory=dict)
    autoscaler: dict[str, Any] | None = None  # what ray_private.autoscaler() found, if any

    def node(self, node_id: str) -> NodeInfo | None:
        return next((n for n in self.nodes if n.node_id == node_id), None)

    @property
    def totals(self) -> dict[str, dict[str, float]]:
        return {n.node_id: n.total for n in self.nodes}

    @property
    def free(self) -> dict[str, dict[str, float]]:
        return {n.node_id: n.free for n in self.nodes}

    def stale_groups(self, rayrl_only: bool = False) -> list[GroupInfo]:
        """Detached groups of finished jobs that no live driver re-attached to."""
        return [
            g
            for g in self.groups
            if g.stale and g.run not in self.attached and (g.is_rayrl or not rayrl_only)
        ]

    def stale_actors(self) -> list[ActorInfo]:
        """Detached rayrl actors, still alive, whose job has finished and whose run no
        live driver re-attached to."""
        rayrl_groups = {g.group_id for g in self.groups if g.is_rayrl}
        return [
            a
            for a in self.actors
            if a.detached
            and a.job_dead
            and a.state != "DEAD"
            and a.is_rayrl(rayrl_groups)
            and a.run not in self.attached
        ]

    def detached_rayrl(self) -> tuple[list[GroupInfo], list[ActorInfo]]:
        """Alive detached rayrl placement groups and actors (stale or in use)."""
        rayrl_groups = {g.group_id for g in self.groups if g.is_rayrl}
        groups = [g for g in self.groups if g.detached and g.is_rayrl]
        actors = [
            a for a in self.actors if a.detached and a.state != "DEAD" and a.is_rayrl(rayrl_groups)
        ]
        return groups, actors

    def other_holders(self) -> dict[str, dict[str, float]]:
        """Per node: resources held outside placement groups, by actors and tasks.

        Actors outside groups are listed separately (`loose_actors`); this is what
        remains of total - free once groups and those actors are accounted for: tasks,
        and anything else the GCS does not name.
        """
        held: dict[str, dict[str, float]] = {}
        for node in self.nodes:
            rest = {k: node.total.get(k, 0.0) - node.free.get(k, 0.0) for k in node.total}
            for g in self.groups:
                for k, v in g.held_per_node().get(node.node_id, {}).items():
                    rest[k] = rest.get(k, 0.0) - v
            for a in self.loose_actors():
                if a.node_id == node.node_id:
                    for k, v in a.resources.items():
                        rest[k] = rest.get(k, 0.0) - v
            rest = {k: v for k, v in rest.items() if v > 1e-6 and k != "object_store_memory"}
            if rest:
                held[node.node_id] = rest
        return held

    def loose_actors(self) -> list[ActorInfo]:
        """Alive actors outside placement groups that hold resources."""
        return [
            a
            for a in self.actors
            if a.state == "ALIVE" and not a.group_id and any(v > 0 for v in a.resources.values())
        ]


def run_of(name: str) -> str:
    """The run part of a rayrl name `rayrl/<run>/...`, or "" for any other name."""
    parts = name.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "rayrl" else ""


def short_id(node_id: str) -> str:
    """The first 8 hex digits of an id: enough to tell nodes apart in a table."""
    return node_id[:8]


def snapshot(include_actors: bool = False) -> ClusterState:
    """Read the cluster state from the GCS of the Ray this process is connected to.

    Actors are always read (the holders of resources outside placement groups);
    `include_actors` also keeps dead ones for the doctor.
    """
    if not ray.is_initialized():
        raise RuntimeError("cluster state needs a Ray connection: call ray.init(address=...) first")
    jobs_dead = ray_private.jobs_dead()
    groups = [_group(raw, jobs_dead) for raw in ray_private.placement_groups()]
    groups = sorted((g for g in groups if g.alive), key=lambda g: (g.name, g.group_id))
    actors = [_actor(raw, jobs_dead) for raw in ray_private.actors()]
    if not include_actors:
        actors = [a for a in actors if a.state != "DEAD"]
    attached = _attached_runs(jobs_dead)
    return ClusterState(_nodes(), groups, jobs_dead, actors, attached, ray_private.autoscaler())


def _nodes() -> list[NodeInfo]:
    totals, free = ray_private.node_resources()
    info = {n["NodeID"]: n for n in ray.nodes() if n.get("Alive")}
    nodes = []
    for node_id in sorted(set(totals) & set(info)):
        meta = info[node_id]
        nodes.append(
            NodeInfo(
                node_id=node_id,
                address=meta.get("NodeManagerAddress", ""),
                is_head="node:__internal_head__" in totals[node_id],
                total=_plain(totals[node_id]),
                free=_plain(free.get(node_id, {})),
            )
        )
    return nodes


def _plain(resources: dict[str, float]) -> dict[str, float]:
    """Drop Ray's bookkeeping resources (per-group and per-node-ip markers)."""
    return {
        k: float(v)
        for k, v in resources.items()
        if "_group_" not in k and not k.startswith("node:") and not k.startswith("bundle_group")
    }


def _group(raw: dict[str, Any], jobs_dead: dict[str, bool]) -> GroupInfo:
    job_dead = raw["job_dead"] or jobs_dead.get(raw["job_id"], False)
    return GroupInfo(**{**raw, "job_dead": job_dead})


def _actor(raw: dict[str, Any], jobs_dead: dict[str, bool]) -> ActorInfo:
    fields = {k: raw[k] for k in ActorInfo.__dataclass_fields__ if k in raw}
    return ActorInfo(**fields, job_dead=jobs_dead.get(raw["job_id"], False))


def attach_key(run: str) -> str:
    """The GCS record naming the drivers that re-attached to a detached run."""
    return f"attached/{run}"


def record_attachment(run: str) -> None:
    """Note that this driver's job uses the detached resources of `run` (see ResourcePool.attach)."""
    key = attach_key(run)
    record = ray_private.kv_get(key) or {"jobs": []}
    job = ray.get_runtime_context().get_job_id()
    if job not in record["jobs"]:
        record["jobs"].append(job)
    ray_private.kv_put(key, record)


def _attached_runs(jobs_dead: dict[str, bool]) -> dict[str, list[str]]:
    """Run -> job ids of the live drivers that re-attached to it."""
    found: dict[str, list[str]] = {}
    for key, record in ray_private.kv_list("attached/").items():
        live = [j for j in record.get("jobs", []) if not jobs_dead.get(j, True)]
        if live:
            found[key.removeprefix("attached/")] = live
    return found


@ray.remote(num_cpus=0)  # type: ignore[untyped-decorator]  # ray is not followed
def _versions() -> dict[str, str]:
    import importlib.metadata as metadata
    import platform

    found = {"python": platform.python_version()}
    for name in VERSION_PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "missing"
    return found


def node_versions(state: ClusterState, timeout_s: float = 30.0) -> dict[str, dict[str, str] | None]:
    """Python and package versions on each node (a tiny zero-CPU task pinned to each).

    A node that does not answer within `timeout_s` maps to None.
    """
    refs = {
        n.node_id: _versions.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(n.node_id, soft=False)
        ).remote()
        for n in state.nodes
    }
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    done = set(ready)
    found: dict[str, dict[str, str] | None] = {}
    for node_id, ref in refs.items():
        found[node_id] = ray.get(ref) if ref in done else None
        if ref not in done:
            ray.cancel(ref, force=True)
    return found


def version_mismatches(versions: dict[str, dict[str, str] | None]) -> dict[str, set[str]]:
    """Packages whose version differs between the nodes that answered."""
    seen: dict[str, set[str]] = {}
    for found in versions.values():
        for name, version in (found or {}).items():
            seen.setdefault(name, set()).add(version)
    return {name: vs for name, vs in seen.items() if len(vs) > 1}


def remove_stale(state: ClusterState) -> list[str]:
    """Remove stale rayrl placement groups and kill stale detached rayrl actors.

    Returns one line per thing removed (or that could not be removed, and why).
    """
    done: list[str] = []
    runs = set()
    for actor in state.stale_actors():
        done.append(_kill_actor(actor))
        runs.add(actor.run)
    for group in state.stale_groups(rayrl_only=True):
        pg = PlacementGroup(ray.PlacementGroupID(bytes.fromhex(group.group_id)))
        ray.util.remove_placement_group(pg)
        done.append(f"removed placement group {group.name} (job {group.job_id})")
        runs.add(group.run)
    for run in runs - {""}:
        ray_private.kv_delete(attach_key(run))  # its re-attach record goes with it
    return done


def _kill_actor(actor: ActorInfo) -> str:
    label = f"actor {actor.name or actor.actor_id} ({actor.class_name}, job {actor.job_id})"
    if not actor.name:
        return f"skipped {label}: unnamed actors cannot be looked up; kill it with `ray kill`"
    try:
        handle = ray.get_actor(actor.name, namespace=actor.namespace)
    except ValueError as err:
        return f"skipped {label}: {err}"
    ray.kill(handle, no_restart=True)
    return f"killed {label}"


def resolve_address(explicit: str | None = None, configured: str | None = None) -> str | None:
    """The Ray cluster a command means: `--address`, else the config's
    `resources.address`, else the RAY_ADDRESS environment variable; None means a
    private local Ray started for the command."""
    return explicit or configured or os.environ.get("RAY_ADDRESS") or None


@contextlib.contextmanager
def connect(address: str | None, num_cpus: int | None = None) -> Iterator[str]:
    """Use the Ray at `address`, or start a private local one when it is None (with
    `num_cpus` logical CPUs when given: as many as a run would start it with).

    Never attaches by "auto" or RAY_ADDRESS on its own: pass `resolve_address(...)` for
    the address a user meant. Reuses this process's connection when it already points
    at `address` (or when `address` is None and Ray is initialised).
    Shuts down only what it started. Yields the GCS address.
    """
    if ray.is_initialized():
        current = ray.get_runtime_context().gcs_address
        if address is None or _same_address(address, current):
            yield current
            return
        raise RuntimeError(
            f"this process is already connected to Ray at {current}, not {address}; "
            "call ray.shutdown() first or pass that address"
        )
    if address is None:
        ctx = ray.init(
            address="local", include_dashboard=False, log_to_driver=False, num_cpus=num_cpus
        )
    else:
        ctx = ray.init(address=address, log_to_driver=False)
    try:
        yield ctx.address_info["gcs_address"]
    finally:
        ray.shutdown()


def _same_address(a: str, b: str) -> bool:
    return a.removeprefix("ray://").strip() == b.strip()
