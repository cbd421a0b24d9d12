"""The rollout pool of asynchronous training: replicas kept busy, weights by version,
replicas that come and go.

`RolloutManager` runs a driver thread beside the trainer (`rollout.mode=async`). Each
replica is a one-rank `WorkerGroup` of `RolloutWorker` on one bundle. The thread:

- hands each idle replica the next prompts of the `SampleQueue` that admission allows
  under the policy version the replica holds, and files the samples when the call
  returns (`ray.wait` over every replica's call);
- offers each policy version the trainer publishes to every replica
  (`RolloutWorker.offer_weights`: fetched beside the replica's running call) and
  dispatches to a replica only once it holds the newest one; the fetch time is
  `async/weight_sync_ms`. With `async_training.weight_transport=collective` the offers
  go out before the trainer publishes (`begin_collective`): each replica joins the
  run's broadcast group (`rayrl.trainer.async_weights`) and receives the buckets
  actor rank 0 broadcasts; a replica whose broadcast fails (or that joins later)
  is offered the object store's copy of that version, with a warning naming it;
- notices a replica whose process or node died: the prompts of its call go back to
  the queue (counted) and training goes on with the others. A replica whose node is
  alive gets a new process in the same bundle; one whose node is gone gets a bundle in
  a placement group of its own, requested at once and placed whenever the cluster has
  room (a node joins, an autoscaler adds one); the new replica loads the newest policy
  and joins. `rollout.max_replicas` above the declared count keeps one more such
  request open, so the pool grows when a node joins.

The trainer never waits on the thread except through the queue; an unexpected error
in it (an exception in a replica's code, not a lost process) is kept and raised in
the trainer's next wait (`check`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from rayrl.cluster.bundle import Bundle
from rayrl.cluster.pool import ResourcePool
from rayrl.config.schema import RayRLConfig
from rayrl.controller import WorkerGroup, start_groups
from rayrl.controller.errors import DEAD_ERRORS, WorkerCallError, WorkerError
from rayrl.controller.future import GroupFuture
from rayrl.engines.weight_sync import PublishedWeights
from rayrl.trainer.async_queue import SampleQueue, WorkItem
from rayrl.trainer.async_weights import CollectiveWeights, weight_sync_timeout
from rayrl.trainer.resources import ROLLOUT_POOL
from rayrl.trainer.roles import GroupEnv
from rayrl.workers.rollout import ReplicaCall, ReplicaResult, RolloutWorker

log = logging.getLogger("rayrl.trainer")

POLL_S = 0.05
MAX_FAILED_STARTS = 3  # new replicas failing to start in a row before the run stops
NODE_CHECK_S = 1.0  # how often idle replicas' nodes are checked (a busy one fails its call)


class NoReplicaError(RuntimeError):
    """No rollout replica was alive for longer than the trainer may wait."""


@dataclass
class Slot:
    """Where a replica runs: a bundle of the run's rollout pool, or the one bundle of a
    placement group the manager requested itself (`pg`, removed at shutdown)."""

    bundle: Bundle
    pg: PlacementGroup | None = None


@dataclass
class Replica:
    """One running replica and what the manager knows of it."""

    name: str
    group: WorkerGroup
    slot: Slot
    # the policy version its next call generates with: the last offer it fetched (a
    # replica swaps a fetched offer in at its next call, or mid-call: partial rollouts)
    version: int
    joined: float = field(default_factory=time.time)
    call: tuple[WorkItem, GroupFuture, float] | None = None  # in flight, and since when
    # offer ref -> (version, sent at, transport)
    offers: dict[Any, tuple[int, float, str]] = field(default_factory=dict)
    busy: list[tuple[float, float]] = field(default_factory=list)  # call spans
    calls: int = 0  # calls that returned samples

    @property
    def node(self) -> str:
        return self.slot.bundle.node_id


class RolloutManager:
    """The rollout replicas of an async run (module docstring).

    Args:
        cfg: the run's config (`rollout.*`, `async_training.*`, `resources.*`).
        queue: the sample queue the replicas work from.
        env: how the run's groups are made (run name, KV store, timeouts).
        model_path: the policy's model directory (every replica starts from it).
        max_lag: the largest version lag a trained sample may have (`ReplicaCall`).
        print_fn: the run's messages (replicas lost and joined).
    """

    def __init__(
        self,
        cfg: RayRLConfig,
        queue: SampleQueue,
        env: GroupEnv,
        model_path: str,
        max_lag: int,
        print_fn=print,
    ) -> None:
        self.cfg, self.queue, self.env = cfg, queue, env
        self.model_path, self.max_lag, self.print = model_path, max_lag, print_fn
        pool = cfg.rollout
        self.declared = pool.nnodes * pool.n_gpus_per_node
        self.max_replicas = pool.max_replicas or self.declared
        per_call = cfg.async_training.prompts_per_call
        self.per_call = per_call or math.ceil(cfg.data.train_batch_size / self.declared)
        self.partial = cfg.async_training.partial_rollout
        self.lock = threading.RLock()
        self.replicas: list[Replica] = []
        self.published: tuple[int, PublishedWeights | None] | None = None
        self.needs_publish = False  # a replica could not fetch the published weights
        self.error: BaseException | None = None
        self.events: list[dict] = []  # replicas lost and joined, for reports and tests
        self.sync_seconds: list[float] = []  # offer fetch times since the last metrics()
        self.gen_seconds: list[float] = []  # replicas' generation per call, likewise
        self._pending: dict[Any, PlacementGroup] = {}  # ready ref -> requested slot
        self._starting = 0
        self._failed_starts = 0
        self._names = 0
        self._slots = 0
        self._shape: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rayrl-rollouts", daemon=True)
        self._last_live = time.monotonic()
        self._nodes_checked = 0.0
        self.collective: CollectiveWeights | None = None  # the collective transport's groups
        # a version being broadcast, not yet published: replicas that received it early
        # are not offered the older one meanwhile
        self.incoming: int | None = None
        self.offers_made: dict[str, int] = {"object_store": 0, "collective": 0}

    # -------------------------------------------------------------- lifecycle
    def start(self, pool: ResourcePool) -> None:
        """Start a replica on every bundle of the run's rollout `pool` (side by side),
        then the manager's thread."""
        self._shape = dict(pool.spec.bundle)
        if self.cfg.async_training.weight_transport == "collective":
            gpus = self._shape.get("GPU", 0) > 0  # NCCL between GPUs, else gloo
            self.collective = CollectiveWeights(self.env.run, gpus, weight_sync_timeout(self.cfg))
        slots = [Slot(bundle) for bundle in pool.bundles]
        made = [(self._group(slot), slot) for slot in slots]
        res = self.cfg.resources
        start_groups(
            [(group, self._init_kwargs()) for group, _ in made],
            create_timeout_s=res.create_timeout_s,
            init_timeout_s=res.init_timeout_s,
            init_retries=res.init_retries,
        )
        with self.lock:
            for group, slot in made:
                self.replicas.append(Replica(group.name, group, slot, version=0))
            self._want_more()
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread, kill every replica, release the placement groups it asked for."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        with self.lock:
            for replica in self.replicas:
                self.events.append(
                    {"event": "stopped", "replica": replica.name, "node": replica.node}
                    | {"time": time.time(), "calls": replica.calls}
                )
                replica.group.shutdown()
                _remove(replica.slot.pg)
            self.replicas.clear()
            for pg in self._pending.values():
                _remove(pg)
            self._pending.clear()

    def _group(self, slot: Slot) -> WorkerGroup:
        self._names += 1
        env = self.env
        group = WorkerGroup(
            RolloutWorker,
            [slot.bundle],
            role=ROLLOUT_POOL,
            run=env.run,
            kv=env.kv,
            name=f"{env.run}/{ROLLOUT_POOL}{self._names - 1}",
            runtime_env={"env_vars": env.debug_env} if env.debug_env else None,
            usage_interval_s=env.usage_interval_s,
        )
        group.stage_timeout_s = env.stage_timeout_s
        return group

    def _init_kwargs(self) -> dict:
        return {"config": self.cfg, "model_path": self.model_path, "version": 0}

    # ---------------------------------------------------------------- weights
    @property
    def published_version(self) -> int | None:
        with self.lock:
            return None if self.published is None else self.published[0]

    def assume(self, version: int) -> None:
        """Declare the replicas' own weights (the model directory) policy `version`."""
        with self.lock:
            self.published, self.needs_publish = (version, None), False
            for replica in self.replicas:
                replica.version = version

    def all_hold(self, version: int) -> bool:
        """Whether every replica holds policy `version` (none is starting or fetching)."""
        with self.lock:
            return self._starting == 0 and all(
                r.version == version and not r.offers for r in self.replicas
            )

    def invalidate(self) -> None:
        """The trainer's policy went back (a restore): nothing is dispatched until it
        publishes again, and the prompts running now are queued again."""
        with self.lock:
            self.published, self.incoming = None, None
            self.queue.reset_running("restored")

    def publish(self, version: int, weights: PublishedWeights) -> None:
        """Policy `version` for every replica (module docstring); replicas joining
        later get it too."""
        with self.lock:
            self.published, self.needs_publish = (version, weights), False
            self.incoming = None
            if weights.fallback and self.collective is not None:
                self.collective.failed()
                self.print(
                    f"WARNING: policy {version} goes to the rollout replicas by the object "
                    f"store, not the broadcast group: {weights.fallback}; the group is formed "
                    "anew at the next publish"
                )
            for replica in self.replicas:
                self._offer(replica)

    def begin_collective(self, version: int) -> dict[str, Any]:
        """Ask every live replica to receive policy `version` over the broadcast group
        (before the trainer's `publish_weights` broadcasts it); the keyword arguments
        of that call (the group, None without replicas, and the header's key)."""
        with self.lock:
            plan = self.collective.plan([r.name for r in self.replicas])
            if plan is None:
                return {"group": None, "key": ""}
            offer = PublishedWeights([], 0, "collective", group=plan.group, key=plan.key)
            self.incoming = version
            for replica in self.replicas:
                actor = replica.group.actor_handle(0, "offer_weights")
                ref = actor.offer_weights.remote(version, offer, plan.ranks[replica.name])
                replica.offers[ref] = (version, time.perf_counter(), "collective")
                self.offers_made["collective"] += 1
            return {"group": plan.group, "key": plan.key}

    def _offer(self, replica: Replica) -> None:
        if self.published is None:
            return
        version, weights = self.published
        if replica.version == version or any(o[0] == version for o in replica.offers.values()):
            return
        if weights is None:  # the model directory's weights: a joining replica has them
            replica.version = version
            return
        weights = weights.by_object_store()  # a broadcast's version too: it missed it
        actor = replica.group.actor_handle(0, "offer_weights")
        ref = actor.offer_weights.remote(version, weights)
        replica.offers[ref] = (version, time.perf_counter(), weights.transport)
        self.offers_made[weights.transport] += 1

    # ------------------------------------------------------------------- loop
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                with self.lock:
                    self._check_nodes()
                    self._dispatch()
                self._collect()
            except Exception as err:  # noqa: BLE001 - raised in the trainer's thread
                log.exception("rollout manager stopped")
                self.error = err
                return

    def _check_nodes(self) -> None:
        """Replicas whose node is gone, noticed while they wait for work."""
        now = time.monotonic()
        if now - self._nodes_checked < NODE_CHECK_S:
            return
        self._nodes_checked = now
        alive = _alive_nodes()
        for replica in [r for r in self.replicas if r.call is None and r.node not in alive]:
            self._lost(replica, RuntimeError(f"node {replica.node} is gone"))

    def _dispatch(self) -> None:
        if self.published is None:
            return
        for replica in self.replicas:
            if replica.call is not None or replica.offers:
                continue
            if replica.version != self.published[0]:
                if replica.version != self.incoming:  # else: it waits for publish()
                    self._offer(replica)
                continue
            item = self.queue.next_work(replica.version, self.per_call)
            if item is None:
                return
            call = ReplicaCall(item.step, self.partial, self.max_lag)
            try:
                future = replica.group.generate.remote(item.prompts, call)
            except WorkerCallError as err:
                self.queue.lose(item)
                self._lost(replica, err)
                return
            replica.call = (item, future, time.time())

    def _collect(self) -> None:
        """Wait a moment for calls, offers and requested bundles; handle what is ready."""
        with self.lock:
            waiting: dict[Any, tuple[str, Any]] = {}
            for replica in self.replicas:
                if replica.call is not None:
                    waiting[replica.call[1].refs[0]] = ("call", replica)
                for ref in replica.offers:
                    waiting[ref] = ("offer", replica)
            for ref, pg in self._pending.items():
                waiting[ref] = ("slot", pg)
        if not waiting:
            time.sleep(POLL_S)
            return
        ready, _ = ray.wait(list(waiting), num_returns=1, timeout=POLL_S, fetch_local=False)
        if ready:
            ready, _ = ray.wait(list(waiting), num_returns=len(waiting), timeout=0)
        with self.lock:
            for ref in ready:
                kind, owner = waiting[ref]
                if kind == "call" and owner in self.replicas:
                    self._call_done(owner)
                elif kind == "offer" and owner in self.replicas:
                    self._offer_done(owner, ref)
                elif kind == "slot" and ref in self._pending:
                    self._slot_ready(ref)
            if self.replicas:
                self._last_live = time.monotonic()

    def _call_done(self, replica: Replica) -> None:
        item, future, started = replica.call
        replica.call = None
        replica.busy.append((started, time.time()))
        try:
            result: ReplicaResult = future.get(timeout=60)
        except WorkerError as err:
            self.queue.lose(item)
            self._lost(replica, err)
            return
        if not result.aborted:
            replica.calls += 1
            self.gen_seconds.append(result.timing.get("gen", 0.0))
        self.queue.complete(item, result.batch, result.versions)

    def _offer_done(self, replica: Replica, ref: Any) -> None:
        version, sent, transport = replica.offers.pop(ref)
        try:
            nbytes = ray.get(ref, timeout=60)
        except DEAD_ERRORS as err:
            self._lost(replica, err)
            return
        except Exception as err:  # noqa: BLE001 - a broadcast failed, or the objects are gone
            if transport == "collective":
                self._broadcast_missed(replica, version, err)
                return
            log.warning(
                "rollout replica %s could not fetch policy %d: %s", replica.name, version, err
            )
            self.needs_publish = True
            return
        self.sync_seconds.append(time.perf_counter() - sent)
        if transport == "collective":
            self.collective.broadcast_bytes += nbytes
        if not replica.offers:
            replica.version = version

    def _broadcast_missed(self, replica: Replica, version: int, err: BaseException) -> None:
        """`replica` did not receive policy `version` over the group: one warning, the
        object store's copy offered (now, or once the trainer has published it), and a
        new group at the next publish."""
        self.collective.failed()
        cause = _one_line(getattr(err, "cause", None) or err)
        self.print(
            f"WARNING: rollout replica {replica.name} missed the broadcast of policy "
            f"{version} ({cause}); it fetches that version from the object store, and the "
            "group is formed anew at the next publish"
        )
        if not replica.offers:
            self._offer(replica)

    # ------------------------------------------------------- losses and joins
    def _lost(self, replica: Replica, err: BaseException) -> None:
        """Take `replica` out; start another in its bundle when its node is alive, else
        ask for a bundle wherever the cluster has room."""
        if isinstance(err, WorkerCallError) and not err.dead:
            raise err  # an error in the replica's code: running again fails again
        self.replicas.remove(replica)
        replica.group.shutdown()
        alive = replica.node in _alive_nodes()
        self.events.append(
            {"event": "lost", "replica": replica.name, "node": replica.node, "time": time.time()}
        )
        where = "its node is alive: a new process in its bundle" if alive else "its node is gone"
        self.print(
            f"WARNING: rollout replica {replica.name} lost ({_one_line(err)}); its prompts are "
            f"queued again, training goes on with {len(self.replicas)} replica(s); {where}"
        )
        if alive:
            self._start_replica(replica.slot)
        else:
            _remove(replica.slot.pg)
            self._want_more()

    def _want_more(self) -> None:
        """Ask for bundles until replicas, replicas starting and bundles asked for
        reach `max_replicas`."""
        while len(self.replicas) + self._starting + len(self._pending) < self.max_replicas:
            self._slots += 1
            name = f"rayrl/{self.env.run}/{ROLLOUT_POOL}/slot{self._slots}"
            pg = placement_group([dict(self._shape)], strategy="PACK", name=name)
            self._pending[pg.ready()] = pg

    def _slot_ready(self, ref: Any) -> None:
        pg = self._pending.pop(ref)
        node = ray.util.placement_group_table(pg)["bundles_to_node_id"][0]
        bundle = Bundle(pg, 0, node, dict(self._shape), pool=f"rayrl/{self.env.run}/{ROLLOUT_POOL}")
        self._start_replica(Slot(bundle, pg))

    def _start_replica(self, slot: Slot) -> None:
        """A new replica on `slot`, started in a thread of its own; it joins (and gets
        the newest policy) once initialised."""
        self._starting += 1
        group = self._group(slot)

        def start() -> None:
            res = self.cfg.resources
            try:
                group.create(res.create_timeout_s)
                group.init(res.init_timeout_s, res.init_retries, **self._init_kwargs())
            except Exception as err:  # noqa: BLE001 - logged; the slot is asked for again
                group.shutdown()
                with self.lock:
                    self._starting -= 1
                    self._failed_starts += 1
                    _remove(slot.pg)
                    self.print(f"WARNING: a new rollout replica failed to start: {_one_line(err)}")
                    if self._failed_starts >= MAX_FAILED_STARTS:
                        self.error = RuntimeError(
                            f"{self._failed_starts} new rollout replicas in a row failed to "
                            f"start; the last: {_one_line(err)} (see its worker log)"
                        )
                    elif not self._stop.is_set():
                        self._want_more()
                return
            with self.lock:
                self._starting -= 1
                self._failed_starts = 0
                if self._stop.is_set():
                    group.shutdown()
                    return
                replica = Replica(group.name, group, slot, version=0)
                self.replicas.append(replica)
                self.events.append(
                    {"event": "joined", "replica": group.name, "node": slot.bundle.node_id}
                    | {"time": time.time()}
                )
                self._offer(replica)
            self.print(
                f"rollout replica {group.name} joined on node {slot.bundle.node_id[:8]} "
                f"({len(self.replicas)} replica(s))"
            )

        threading.Thread(target=start, name="rayrl-rollout-start", daemon=True).start()

    # ---------------------------------------------------------------- trainer
    def check(self, wait_s: float) -> None:
        """Raise what the thread kept, or NoReplicaError when no replica was alive for
        `wait_s` seconds (None: wait as long as it takes)."""
        if self.error is not None:
            raise self.error
        with self.lock:
            if self.replicas or wait_s is None:
                return
            idle = time.monotonic() - self._last_live
        if idle > wait_s:
            raise NoReplicaError(
                f"no rollout replica has been alive for {idle:.0f} s (trainer.stage_timeout_s="
                f"{wait_s:.0f}); {len(self._pending)} bundle(s) of {self._shape} are waiting "
                "for room in the cluster: add a node, or lower rollout.gpus_per_replica / "
                "rollout.cpus_per_replica"
            )

    def metrics(self, since: float, until: float) -> dict[str, float]:
        """`async/replicas`, `async/weight_sync_ms` (the mean offer time since the last
        call), `async/rollout_call_s` (the mean generation time of a replica call since
        then), `perf/rollout_idle_fraction` (the share of the replicas' time from
        `since` to `until` with no call running), and with the collective transport
        `async/weight_transport_fallbacks` (replicas that missed a broadcast, plus one
        for each send of actor rank 0 that failed) and `async/weight_broadcast_bytes`
        (received by the replicas over the group)."""
        with self.lock:
            busy = alive = 0.0
            for replica in self.replicas:
                start = max(since, replica.joined)
                alive += max(0.0, until - start)
                spans = list(replica.busy)
                if replica.call is not None:
                    spans.append((replica.call[2], until))
                busy += sum(max(0.0, min(e, until) - max(s, start)) for s, e in spans)
                replica.busy = [(s, e) for s, e in replica.busy if e > until]
            out = {"async/replicas": float(len(self.replicas))}
            if alive > 0:
                out["perf/rollout_idle_fraction"] = max(0.0, 1.0 - busy / alive)
            if self.sync_seconds:
                out["async/weight_sync_ms"] = 1000 * sum(self.sync_seconds) / len(self.sync_seconds)
                self.sync_seconds = []
            if self.gen_seconds:
                out["async/rollout_call_s"] = sum(self.gen_seconds) / len(self.gen_seconds)
                self.gen_seconds = []
            if self.collective is not None:
                out.update(self.collective.metrics())
            return out

    def usage(self) -> list[dict]:
        """The live replicas' usage reports (`WorkerGroup.usage`), one each."""
        with self.lock:
            groups = [r.group for r in self.replicas]
        reports = []
        for group in groups:
            try:
                reports.extend(group.usage(timeout_s=5.0))
            except Exception:  # noqa: BLE001 - a replica lost meanwhile has no report
                continue
        return reports


def _alive_nodes() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


def _remove(pg: PlacementGroup | None) -> None:
    if pg is None:
        return
    try:
        remove_placement_group(pg)
    except Exception as err:  # noqa: BLE001 - already gone is fine
        log.debug("placement group not removed: %s", err)


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
