"""The rollout pool of asynchronous training: replicas kept busy, weights by version.

`RolloutManager` runs a driver thread beside the trainer (`rollout.mode=async`). The
replicas themselves (one-rank groups of `RolloutWorker`, one per bundle of the run's
rollout pool) are placed, replaced and grown by a `ReplicaSet`
(`rayrl.controller.replicas`: the controller's formation path, the pool's bundles);
this module decides what they do. The thread:

- hands the next prompts of the `SampleQueue` that admission allows under the policy
  version a replica holds to the least-loaded replica, up to
  `async_training.calls_per_replica` calls in flight on each (their samples share the
  replica's engine batch: a call's long tail never leaves a replica idle), and files
  the samples when a call returns (`ray.wait` over every call in flight);
- offers each policy version the trainer publishes to every replica
  (`RolloutWorker.offer_weights`: fetched beside the replica's running calls, swapped
  in between engine steps) and dispatches to a replica only once it holds the newest
  one; the fetch time is `async/weight_sync_ms`. With
  `async_training.weight_transport=collective` the offers go out before the trainer
  publishes (`begin_collective`): each replica joins the run's broadcast group
  (`rayrl.trainer.async_weights`) and receives the buckets actor rank 0 broadcasts; a
  replica whose broadcast fails (or that joins later) is offered the object store's
  copy of that version, with a warning naming it;
- notices a replica whose process or node died: the prompts of its calls go back to
  the queue (counted), training goes on with the others, and the replica set brings a
  new one up (in the same bundle, or wherever the cluster has room); a new replica
  loads the newest policy and joins. `rollout.max_replicas` above the declared count
  lets the set grow when a node joins.

An episode (multi-turn) lives in one call on one replica from its first turn to its
last, so its later turns always find its KV cache where it is (session affinity by
construction). The trainer never waits on the thread except through the queue; an
unexpected error in it (an exception in a replica's code, not a lost process) is kept
and raised in the trainer's next wait (`check`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import ray

from rayrl.cluster.bundle import Bundle
from rayrl.cluster.pool import ResourcePool
from rayrl.config.schema import RayRLConfig
from rayrl.controller import WorkerGroup
from rayrl.controller.errors import DEAD_ERRORS, WorkerCallError, WorkerError
from rayrl.controller.future import GroupFuture
from rayrl.controller.placement import alive_nodes
from rayrl.controller.replicas import Member, ReplicaSet
from rayrl.train.weight_sync import PublishedWeights
from rayrl.trainer.async_queue import QUEUED, SampleQueue, WorkItem
from rayrl.trainer.async_weights import CollectiveWeights, weight_sync_timeout
from rayrl.trainer.metrics import prefix_cache_metrics
from rayrl.trainer.protocols import ReplicaRole
from rayrl.trainer.resources import ROLLOUT_POOL
from rayrl.trainer.roles import GroupEnv
from rayrl.workers.rollout import ReplicaCall, ReplicaResult, RolloutWorker

log = logging.getLogger("rayrl.trainer")

POLL_S = 0.05
NODE_CHECK_S = 1.0  # how often idle replicas' nodes are checked (a busy one fails its call)


class NoReplicaError(RuntimeError):
    """No rollout replica was alive for longer than the trainer may wait."""


@dataclass
class Replica:
    """One replica of the set (`Member`) and what the manager knows of it."""

    member: Member
    # the policy version its next call generates with: the last offer it fetched (a
    # replica swaps a fetched offer in between engine steps)
    version: int
    in_flight: dict[Any, tuple[WorkItem, GroupFuture, float]] = field(default_factory=dict)
    # offer ref -> (version, sent at, transport)
    offers: dict[Any, tuple[int, float, str]] = field(default_factory=dict)
    busy: list[tuple[float, float]] = field(default_factory=list)  # call spans
    calls: int = 0  # calls that returned samples
    counters: dict[str, float] = field(default_factory=dict)  # its engine's, last seen

    @property
    def name(self) -> str:
        return self.member.name

    @property
    def group(self) -> WorkerGroup:
        return self.member.group

    @property
    def node(self) -> str:
        return self.member.node

    @property
    def joined(self) -> float:
        return self.member.joined


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
        print_fn: Callable[[str], None] = print,
    ) -> None:
        self.cfg, self.queue, self.env = cfg, queue, env
        self.model_path, self.max_lag, self.print = model_path, max_lag, print_fn
        pool, a = cfg.rollout, cfg.async_training
        # a replica is one rank, or `tensor_model_parallel_size` ranks splitting the model
        # (native engine); their ranks run in lockstep, one call at a time
        self.ranks = max(1, cfg.actor_rollout_ref.rollout.tensor_model_parallel_size)
        self.declared = pool.nnodes * pool.n_gpus_per_node // self.ranks
        self.max_replicas = pool.max_replicas or self.declared
        self.per_call = a.prompts_per_call or math.ceil(cfg.data.train_batch_size / self.declared)
        self.calls_per_replica = a.calls_per_replica if self.ranks == 1 else 1
        self.partial = a.partial_rollout
        self.lock = threading.RLock()
        self.replicas: list[Replica] = []
        self.set: ReplicaSet | None = None
        self.pool: ResourcePool | None = None
        self.published: tuple[int, PublishedWeights | None] | None = None
        self.needs_publish = False  # a replica could not fetch the published weights
        self.error: BaseException | None = None
        self.sync_seconds: list[float] = []  # offer fetch times since the last metrics()
        self.gen_seconds: list[float] = []  # replicas' generation per call, likewise
        self.counts: dict[str, float] = {}  # replicas' engine counters' growth, likewise
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
        """Start a replica on every bundle of the run's rollout `pool` (side by side,
        `ReplicaSet.start`), then the manager's thread."""
        if self.cfg.async_training.weight_transport == "collective":
            gpus = pool.spec.bundle.get("GPU", 0) > 0  # NCCL between GPUs, else gloo
            self.collective = CollectiveWeights(self.env.run, gpus, weight_sync_timeout(self.cfg))
        res = self.cfg.resources
        self.pool = pool
        self.set = ReplicaSet(
            pool,
            self._group,
            self._init_kwargs,
            max_size=self.max_replicas,
            timeouts={
                "create_timeout_s": res.create_timeout_s,
                "init_timeout_s": res.init_timeout_s,
                "init_retries": res.init_retries,
            },
            on_join=self._joined,
            print_fn=self.print,
            label="rollout replica",
            ranks_per_replica=self.ranks,
        )
        self.set.start()
        with self.lock:
            self.replicas = [Replica(member, version=0) for member in self.set.members]
        self._thread.start()

    def _replica_set(self) -> ReplicaSet:
        if self.set is None:
            raise RuntimeError("the rollout replicas are not started yet: call start() first")
        return self.set

    def _collective(self) -> CollectiveWeights:
        if self.collective is None:
            raise RuntimeError(
                "no broadcast group: async_training.weight_transport is not collective"
            )
        return self.collective

    @property
    def events(self) -> list[dict[str, Any]]:
        """Replicas lost, joined and stopped (`ReplicaSet.events`)."""
        return self.set.events if self.set is not None else []

    def stop(self) -> None:
        """Stop the thread, then every replica (their bundle requests withdrawn)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        with self.lock:
            if self.set is not None:
                self.set.stop()
            self.replicas.clear()

    def _group(self, name: str, bundles: list[Bundle]) -> WorkerGroup:
        env = self.env
        group = WorkerGroup(
            RolloutWorker,
            bundles,
            role=ROLLOUT_POOL,
            run=env.run,
            kv=env.kv,
            pool=self.pool,
            name=name,
            runtime_env={"env_vars": env.debug_env} if env.debug_env else None,
            usage_interval_s=env.usage_interval_s,
        )
        group.stage_timeout_s = env.stage_timeout_s
        return group

    def _init_kwargs(self) -> dict[str, Any]:
        """A replica's `init_worker` arguments; a replica of several ranks forms a
        process group (NCCL between GPUs, else gloo) for its tensor parallelism."""
        kwargs = {"config": self.cfg, "model_path": self.model_path, "version": 0}
        if self.ranks > 1:
            gpus = self.pool is not None and self.pool.spec.bundle.get("GPU", 0) > 0
            kwargs["backend"] = "nccl" if gpus else "gloo"
        return kwargs

    def _joined(self, member: Member) -> None:
        """A new or replaced replica is ready (`ReplicaSet.on_join`, under its lock):
        it starts at the model directory's version and is offered the newest."""
        with self.lock:
            replica = Replica(member, version=0)
            self.replicas.append(replica)
            self._offer(replica)

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
            return self._replica_set().starting == 0 and all(
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
                self.collective.send_failed()  # the replicas that missed it count it
                self.print(
                    f"WARNING: policy {version} goes to the rollout replicas by the object "
                    f"store, not the broadcast group: {weights.fallback}; the group is formed "
                    "anew at the next publish"
                )
            for replica in self.replicas:
                self._offer(replica)

    def begin_collective(self, version: int, sender: int = 0) -> dict[str, Any]:
        """Ask every live replica to receive policy `version` over the broadcast group
        (before the trainer's `publish_weights` broadcasts it from actor rank 0 of the
        training group's generation `sender`); the keyword arguments of that call (the
        group, None without replicas, and the header's key)."""
        with self.lock:
            plan = self._collective().plan([r.name for r in self.replicas], sender)
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

    def sender_lost(self) -> None:
        """The trainer's publish died before it returned: the replicas waiting for its
        broadcast stop waiting (each then takes the object store's copy once the
        trainer publishes again)."""
        with self.lock:
            if self.collective is not None:
                self.collective.sender_lost()

    def _offer(self, replica: Replica) -> None:
        if self.published is None or self.needs_publish:  # its objects are gone: wait
            return
        version, weights = self.published
        if replica.version == version or any(o[0] == version for o in replica.offers.values()):
            return
        if weights is None:  # the model directory's weights: a joining replica has them
            replica.version = version
            return
        weights = weights.by_object_store()  # a broadcast's version too: it missed it
        for rank in range(replica.group.world_size):  # each rank takes its own part
            actor = replica.group.actor_handle(rank, "offer_weights")
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
        """Replicas whose node is gone, noticed while they wait for work (a busy one
        fails its calls)."""
        now = time.monotonic()
        if now - self._nodes_checked < NODE_CHECK_S:
            return
        self._nodes_checked = now
        alive = alive_nodes()
        for replica in [r for r in self.replicas if not r.in_flight and r.node not in alive]:
            self._lost(replica, RuntimeError(f"node {replica.node} is gone"))

    def _dispatch(self) -> None:
        """Work for the least-loaded replicas that hold the newest policy, up to
        `calls_per_replica` calls in flight each."""
        if self.published is None:
            return
        while True:
            ready = []
            for replica in self.replicas:
                if replica.offers or len(replica.in_flight) >= self.calls_per_replica:
                    continue
                if replica.version != self.published[0]:
                    if replica.version != self.incoming:  # else: it waits for publish()
                        self._offer(replica)
                    continue
                ready.append(replica)
            if not ready:
                return
            replica = min(ready, key=lambda r: len(r.in_flight))
            item = self.queue.next_work(replica.version, self.per_call)
            if item is None:
                return
            call = ReplicaCall(item.step, self.partial, self.max_lag)
            try:
                group = cast(ReplicaRole, replica.group)  # its methods are bound at start
                future = group.generate.remote(item.prompts, call)
            except WorkerCallError as err:
                self.queue.lose(item)
                self._lost(replica, err)
                return
            replica.in_flight[future.refs[0]] = (item, future, time.time())

    def _collect(self) -> None:
        """Wait a moment for calls, offers and requested bundles; handle what is ready."""
        with self.lock:
            waiting: dict[Any, tuple[str, Any]] = {}
            for replica in self.replicas:
                for ref in replica.in_flight:
                    waiting[ref] = ("call", replica)
                for ref in replica.offers:
                    waiting[ref] = ("offer", replica)
            replica_set = self._replica_set()
            for ref in replica_set.pending:
                waiting[ref] = ("slot", None)
        if not waiting:
            time.sleep(POLL_S)
            return
        ready, _ = ray.wait(list(waiting), num_returns=1, timeout=POLL_S, fetch_local=False)
        if ready:
            ready, _ = ray.wait(list(waiting), num_returns=len(waiting), timeout=0)
        placed = []
        with self.lock:
            for ref in ready:
                kind, replica = waiting[ref]
                if kind == "call" and replica in self.replicas and ref in replica.in_flight:
                    self._call_done(replica, ref)
                elif kind == "offer" and replica in self.replicas:
                    self._offer_done(replica, ref)
                elif kind == "slot":
                    placed.append(ref)
            if self.replicas:
                self._last_live = time.monotonic()
        for ref in placed:  # outside the lock: the set takes its own
            replica_set.placed(ref)

    def _call_done(self, replica: Replica, ref: Any) -> None:
        item, future, started = replica.in_flight.pop(ref)
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
        for name, value in result.counters.items():  # growth since its last result
            grown = value - replica.counters.get(name, 0.0)
            self.counts[name] = self.counts.get(name, 0.0) + max(grown, 0.0)
            replica.counters[name] = max(value, replica.counters.get(name, 0.0))
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
            self.print(
                f"WARNING: rollout replica {replica.name} could not fetch policy {version} "
                f"({_one_line(err)}); the trainer publishes it again"
            )
            self.needs_publish = True  # no offer of the lost objects until then
            return
        self.sync_seconds.append(time.perf_counter() - sent)
        if transport == "collective":
            self._collective().broadcast_bytes += nbytes
        if not replica.offers:
            replica.version = version

    def _broadcast_missed(self, replica: Replica, version: int, err: BaseException) -> None:
        """`replica` did not receive policy `version` over the group: one warning, the
        object store's copy offered (now, or once the trainer has published it), and a
        new group at the next publish."""
        self._collective().failed()
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
        """`replica` is gone: the prompts of its calls are queued again, and the replica
        set brings another up (`ReplicaSet.lose`). An error in the replica's own code
        (its process alive) is raised: running again would fail again."""
        if isinstance(err, WorkerCallError) and not err.dead:
            raise err
        if replica not in self.replicas:
            return
        self.replicas.remove(replica)
        for item, _, _ in replica.in_flight.values():
            self.queue.lose(item)
        replica.in_flight.clear()
        if self.collective is not None:  # a broadcast waiting for it ends now
            self.collective.abandon(replica.name)
        self._replica_set().lose(replica.member, err)

    # ---------------------------------------------------------------- trainer
    def check(self, wait_s: float | None) -> None:
        """Raise what the thread (or the replica set) kept, or NoReplicaError when no
        replica was alive for `wait_s` seconds (None: wait as long as it takes)."""
        if self.error is not None:
            raise self.error
        if self.set is not None and self.set.error is not None:
            raise self.set.error
        with self.lock:
            if self.replicas or wait_s is None:
                return
            idle = time.monotonic() - self._last_live
        if idle > wait_s:
            shape = self.pool.spec.bundle if self.pool is not None else {}
            pending = len(self.set.pending) if self.set is not None else 0
            raise NoReplicaError(
                f"no rollout replica has been alive for {idle:.0f} s (trainer.stage_timeout_s="
                f"{wait_s:.0f}); {pending} bundle(s) of {shape} are waiting "
                "for room in the cluster: add a node, or lower rollout.gpus_per_replica / "
                "rollout.cpus_per_replica"
            )

    def metrics(self, since: float, until: float) -> dict[str, float]:
        """`async/replicas`, `async/weight_sync_ms` (the mean offer time since the last
        call), `async/rollout_call_s` (the mean generation time of a replica call since
        then), `perf/rollout_idle_fraction` (the share of the replicas' time from
        `since` to `until` with no call running), `rollout/prefix_cache_hit_rate`
        (of the replicas' prompt tokens since the last call), the load now (`async/replica_calls/
        mean` and `max`: calls in flight per replica; `async/queued_prompts`: prompts
        fed and not yet handed to a replica), and with the collective transport
        `async/weight_transport_fallbacks` (replicas that missed a broadcast, one for
        each replica and version) and `async/weight_broadcast_bytes`
        (received by the replicas over the group)."""
        with self.lock:
            busy = alive = 0.0
            for replica in self.replicas:
                start = max(since, replica.joined)
                alive += max(0.0, until - start)
                spans = list(replica.busy) + [(t, until) for _, _, t in replica.in_flight.values()]
                busy += _covered(spans, start, until)
                replica.busy = [(s, e) for s, e in replica.busy if e > until]
            loads = [len(r.in_flight) for r in self.replicas]
            out = {
                "async/replicas": float(len(self.replicas)),
                "async/replica_calls/mean": sum(loads) / len(loads) if loads else 0.0,
                "async/replica_calls/max": float(max(loads, default=0)),
                "async/queued_prompts": float(self.queue.counts()[QUEUED]),
            }
            if alive > 0:
                out["perf/rollout_idle_fraction"] = max(0.0, 1.0 - busy / alive)
            if self.sync_seconds:
                out["async/weight_sync_ms"] = 1000 * sum(self.sync_seconds) / len(self.sync_seconds)
                self.sync_seconds = []
            if self.gen_seconds:
                out["async/rollout_call_s"] = sum(self.gen_seconds) / len(self.gen_seconds)
                self.gen_seconds = []
            out.update(prefix_cache_metrics(self.counts))
            self.counts = {}
            if self.collective is not None:
                out.update(self.collective.metrics())
            return out

    def usage(self) -> list[dict[str, Any]]:
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


def _covered(spans: list[tuple[float, float]], start: float, until: float) -> float:
    """Seconds of [start, until] inside at least one of `spans` (calls side by side
    count once)."""
    clipped = sorted((max(s, start), min(e, until)) for s, e in spans if e > start and s < until)
    total, end = 0.0, start
    for s, e in clipped:
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
