"""WorkerGroup: one Ray actor per reserved bundle, called as one object.

Life of a group, each phase with its own timeout and its own error::

    group = WorkerGroup(Actor, pool.bundles, role="actor", run="exp1", kv=kv, pool=pool)
    group.create(timeout_s=60)                  # place actors; wait until they are alive
    group.init(timeout_s=600, retries=2, backend="gloo", pg_timeout_s=600, model_path=...)
    phase = group.create(blocking=False)        # either phase, started: a PhaseFuture
    phase.result()                              # waits; raises the phase's own error
    out = group.log_prob(batch)                 # methods registered with @register
    fut = group.log_prob.remote(batch)          # non-blocking: a GroupFuture
    report = group.check_health(timeout_s=5)    # dead or silent ranks
    group.replace(rank)                         # explicit, logged replacement
    group.add_call_hook(hook)                   # run in each worker call (controller.calls)
    group.shutdown()

Actors are created with `max_restarts=0`: Ray never restarts a worker behind the
controller's back. A dead or hung worker is noticed (an actor-died error on a call, a missed heartbeat,
or the watchdog: no progress within `stage_timeout_s`) and replaced with
`replace(rank)`: in its own bundle when its node is alive, otherwise in a spare bundle
of the pool (a topology change, warned with both node ids). Init, its retries and
every replacement go through one path (`rayrl.controller.formation`): busy survivors
get `abort_grace_s` and are then killed too, the lost ranks are respawned, the process
group re-forms under a new generation, and engines rebuild. Restoring the state of the
step is `rayrl.controller.recovery`'s part.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, overload

import ray
from ray import ObjectRef

from rayrl.cluster import ray_private
from rayrl.cluster.bundle import Bundle
from rayrl.cluster.kv import KVStore
from rayrl.cluster.pool import ResourcePool
from rayrl.controller.calls import CallHook
from rayrl.controller.dispatch import MethodSpec, method_specs
from rayrl.controller.errors import (
    DEAD_ERRORS,
    WorkerCallError,
    WorkerCreateError,
    WorkerDescription,
    WorkerError,
    failure_hint,
    short_error,
    timeout_text,
)
from rayrl.controller.formation import bring_up
from rayrl.controller.health import HealthReport, Replacement, check_group
from rayrl.controller.layout import DataLayout
from rayrl.controller.method import bind_methods
from rayrl.controller.startup import PhaseFuture, in_background
from rayrl.controller.waiting import wait_all
from rayrl.controller.watchdog import Watchdog
from rayrl.controller.wire import set_wire_for_cluster
from rayrl.controller.worker import CONCURRENCY_GROUPS, Worker, WorkerContext, find_log_file

logger = logging.getLogger("rayrl.controller")


def bundle_label(bundle: Bundle) -> str:
    """A short name for a bundle in messages: pool, index, placement group, node."""
    pg = bundle.pg.id.hex()[:12] if bundle.pg is not None else "?"
    kind = "spare " if bundle.spare else ""
    return (
        f"{kind}bundle {bundle.index} of pool '{bundle.pool or '?'}' "
        f"(placement group {pg}, node {bundle.node_id or '?'}, {bundle.resources})"
    )


class WorkerGroup:
    """A group of `worker_cls` actors, one per bundle, rank i on `bundles[i]`.

    `kv` (a KVStore handle) is needed for `init(backend=...)`; `pool` (a ResourcePool)
    gives spare bundles to `replace` when a node is gone. `args`/`kwargs` go to every
    worker's constructor.
    """

    def __init__(
        self,
        worker_cls: type[Worker],
        bundles: list[Bundle],
        role: str,
        run: str = "",
        kv: KVStore | None = None,
        *,
        pool: ResourcePool | None = None,
        name: str | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        runtime_env: dict[str, Any] | None = None,
        usage_interval_s: float = 0.5,
    ) -> None:
        if not (isinstance(worker_cls, type) and issubclass(worker_cls, Worker)):
            raise TypeError(
                f"WorkerGroup needs a plain subclass of rayrl.controller.Worker, got {worker_cls!r}; "
                "do not decorate it with @ray.remote (the group does that)"
            )
        if not bundles:
            raise ValueError(f"WorkerGroup '{role}' got no bundles; reserve a ResourcePool first")
        self.worker_cls = worker_cls
        self.bundles = list(bundles)
        self.role = role
        self.run = run
        self.kv = kv
        self.pool = pool
        self.name = name or f"{run or 'rayrl'}/{role}"
        # Discovery keys of this object's process groups: never shared with an earlier
        # or later group of the same name (whose generations also start at 0).
        self.scope = f"{self.name}/{uuid.uuid4().hex[:8]}"
        self._ctor = (tuple(args), dict(kwargs or {}))
        self._runtime_env = runtime_env
        self.usage_interval_s = usage_interval_s
        self.actors: list[Any] = [None] * len(self.bundles)
        self.infos: list[dict[str, Any]] = [{} for _ in self.bundles]
        self.generation = 0
        self.formed = False  # whether generation `generation` was formed already
        self.built: list[int | None] = [None] * len(self.bundles)  # generation built on
        self.backend: str | None = None
        self.dist_timeout_s = 60.0
        self.pg_timeout_s: float | None = None  # collectives' timeout (torch's when None)
        self.abort_grace_s = 10.0  # survivors' time to end their call after a loss
        self.placement_timeout_s = 30.0  # for a new bundle when the pool has no spare left
        self.stage_timeout_s: float | None = None  # watchdog: longest call without progress
        # which ranks share the rows of a DP_SPLIT call, by the layout name its method
        # follows (`rayrl.controller.layout`); unnamed layouts split over every rank
        self.data_layouts: dict[str, DataLayout] = {}
        self.call_hooks: list[CallHook] = []  # installed in every worker started from now on
        self._init_kwargs: dict[str, Any] | None = None
        self.dead: set[int] = set()
        # Guards `actors` between the driver and a HealthMonitor thread.
        self.lock = threading.RLock()
        self._replacing: set[int] = set()
        self._actor_cls = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(worker_cls)
        self.specs = method_specs(worker_cls)
        bind_methods(self, self.specs, reserved=set(dir(WorkerGroup)) | set(vars(self)))

    def __repr__(self) -> str:
        return f"WorkerGroup({self.name!r}, world_size={self.world_size}, generation={self.generation})"

    @property
    def world_size(self) -> int:
        """Number of ranks (one per bundle)."""
        return len(self.bundles)

    @property
    def forms_process_group(self) -> bool:
        """Whether this group's ranks form a torch.distributed group (init with a backend)."""
        return bool(self.backend)

    # --- phase 1: create ----------------------------------------------------------------

    def create(
        self, timeout_s: float = 60.0, *, blocking: bool = True
    ) -> WorkerGroup | PhaseFuture:
        """Place one actor per bundle and wait (bounded) until every one is alive.

        `blocking=False` returns once the actors are requested: a PhaseFuture whose
        `result()` waits (`timeout_s` counted from now) and raises WorkerCreateError."""
        set_wire_for_cluster()  # the driver's side of how the group's data travels
        pending = {rank: self._spawn(rank) for rank in range(self.world_size)}
        deadline = time.monotonic() + timeout_s
        phase = PhaseFuture(self, "create", lambda: self._finish_create(pending, deadline))
        return phase.result() if blocking else phase

    def _finish_create(self, pending: dict[int, ObjectRef], deadline: float) -> WorkerGroup:
        timeout_s = max(0.0, deadline - time.monotonic())
        failures = self._collect_setup(pending, timeout_s)
        if failures:
            stage = f"{self.worker_cls.__name__}.__init__"
            self._raise(WorkerCreateError, stage, failures, timeout_s, cleanup=True)
        logger.info("created %s: %d workers", self.name, self.world_size)
        return self

    def _context(self, rank: int) -> WorkerContext:
        nodes = [b.node_id for b in self.bundles]
        node = nodes[rank]
        return WorkerContext(
            group=self.name,
            role=self.role,
            rank=rank,
            world_size=self.world_size,
            local_rank=nodes[:rank].count(node),
            local_world_size=nodes.count(node),
            run=self.run,
            kv=self.kv,
            generation=self.generation,
            scope=self.scope,
            usage_interval_s=self.usage_interval_s,
            num_cpus=float(self.bundles[rank].resources.get("CPU", 0.0)),
            num_gpus=float(self.bundles[rank].resources.get("GPU", 0.0)),
        )

    def _spawn(self, rank: int) -> ObjectRef:
        """Start rank's actor on its bundle; returns the ref of its setup call."""
        bundle = self.bundles[rank]
        shape = dict(bundle.resources)
        options: dict[str, Any] = {
            "num_cpus": shape.pop("CPU", 0),
            "num_gpus": shape.pop("GPU", 0),
            "max_restarts": 0,
            "max_task_retries": 0,
            "scheduling_strategy": bundle.scheduling_strategy(),
        }
        if "memory" in shape:
            options["memory"] = shape.pop("memory")
        shape.pop("object_store_memory", None)
        if shape:
            options["resources"] = shape
        if self._runtime_env:
            options["runtime_env"] = self._runtime_env
        args, kwargs = self._ctor
        actor = self._actor_cls.options(**options).remote(*args, **kwargs)
        with self.lock:
            self.actors[rank] = actor
        self.infos[rank] = {"node_id": bundle.node_id}
        return self.actors[rank]._rayrl_setup.remote(self._context(rank), tuple(self.call_hooks))

    def _collect_setup(
        self, pending: dict[int, ObjectRef], timeout_s: float
    ) -> dict[int, BaseException]:
        results, failures = wait_all(pending, timeout_s)
        for rank, info in results.items():
            self.infos[rank] = info
        return failures

    # --- phase 2: init ------------------------------------------------------------------

    def init(
        self,
        timeout_s: float = 600.0,
        retries: int = 0,
        backend: str | None = None,
        dist_timeout_s: float = 60.0,
        pg_timeout_s: float | None = None,
        *,
        blocking: bool = True,
        **kwargs: Any,
    ) -> WorkerGroup | PhaseFuture:
        """Form the process group (with `backend`: "gloo", "nccl"), then run every
        worker's `init_worker(**kwargs)`, each within `timeout_s`.

        The ranks find each other through KV discovery within `dist_timeout_s`; their
        collectives then time out after `pg_timeout_s` (torch's default when None). A
        worker that fails or times out is killed and recreated in its bundle and tried
        again, up to `retries` more times; with a backend the group re-forms and the
        others rebuild, without one they are not touched. `blocking=False` runs all
        of it in a background thread and returns a PhaseFuture whose `result()` waits
        for it and raises WorkerInitError (several groups then start side by side).
        """
        if backend and self.kv is None:
            raise ValueError(
                f"{self.name}: init(backend={backend!r}) forms a process group through KV "
                "discovery; create the group with kv=KVStore.create(run)"
            )
        self.worker_cls.check_init_kwargs(kwargs)
        self._init_kwargs = dict(kwargs)
        self.backend = backend
        self.dist_timeout_s = dist_timeout_s
        self.pg_timeout_s = pg_timeout_s
        if not blocking:
            return in_background(self, "init", lambda: self._bring_up(timeout_s, retries))
        return self._bring_up(timeout_s, retries)

    def _bring_up(self, timeout_s: float, retries: int) -> WorkerGroup:
        bring_up(self, set(), timeout_s, retries, "init_worker")
        logger.info("initialised %s: %d workers", self.name, self.world_size)
        return self

    @contextlib.contextmanager
    def replacing(self, ranks: Iterable[int]) -> Iterator[Callable[[Iterable[int]], None]]:
        """Mark `ranks` as being replaced (health checks skip them) while the block runs;
        the block gets a function that marks more."""
        marked: set[int] = set()

        def mark(more: Iterable[int]) -> None:
            with self.lock:
                new = set(more) - self._replacing
                self._replacing.update(new)
                marked.update(new)

        mark(ranks)
        try:
            yield mark
        finally:
            with self.lock:
                self._replacing.difference_update(marked)

    def _drop_discovery_keys(self, keep: str | None = None) -> None:
        """Delete this group's discovery keys, except those under `keep` (the current
        generation's, which timeout reports show as the nearest keys)."""
        if self.kv is None:
            return
        from rayrl.cluster.discovery import DISCOVERY_NAMESPACE

        try:
            keys = self.kv.list(self.scope + "/", namespace=DISCOVERY_NAMESPACE)
            for prefix in sorted({k[: k.index("/", len(self.scope) + 1) + 1] for k in keys}):
                if prefix != keep:
                    self.kv.delete_prefix(prefix, namespace=DISCOVERY_NAMESPACE)
        except Exception as err:  # noqa: BLE001 - a dead KV store leaves nothing to clean
            logger.debug("%s: discovery keys not deleted: %s", self.name, err)

    # --- calls --------------------------------------------------------------------------

    def actor_handle(self, rank: int, stage: str = "call") -> Any:
        """Rank's actor handle; WorkerCallError if the group has none for it (not created,
        shut down, or its replacement failed)."""
        actor = self.actors[rank]
        if actor is None:
            raise WorkerCallError(
                stage,
                self.describe(rank),
                "this rank has no worker: the group was not created, was shut down, or the "
                "rank's replacement failed",
                hint=f"call group.create() first, or group.replace({rank})",
            )
        return actor

    def _invoke(
        self, rank: int, spec: MethodSpec, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> ObjectRef:
        method = getattr(self.actor_handle(rank, spec.name), spec.name)
        if spec.options:
            method = method.options(**spec.options)
        return method.remote(*args, **kwargs)

    def describe(self, rank: int) -> WorkerDescription:
        """What is known about rank's worker: node, pid, log file and bundle."""
        info = self.infos[rank] if 0 <= rank < len(self.infos) else {}
        bundle = self.bundles[rank] if 0 <= rank < len(self.bundles) else None
        return WorkerDescription(
            role=self.role,
            rank=rank,
            node_id=info.get("node_id") or (bundle.node_id if bundle else "?"),
            pid=info.get("pid"),
            log_file=info.get("log_file", ""),
            bundle=bundle_label(bundle) if bundle else "",
            group=self.name,
        )

    def data_layout(self, name: str | None) -> DataLayout | None:
        """The data layout `name` (None: none set, split over every rank)."""
        return self.data_layouts.get(name) if name else None

    def _note_error(self, rank: int, err: BaseException) -> None:
        if isinstance(err, DEAD_ERRORS):
            self.dead.add(rank)
            logger.warning("%s rank %d is dead: %s", self.name, rank, short_error(err))

    @property
    def watchdog(self) -> Watchdog | None:
        """Progress checks for this group's calls while `stage_timeout_s` is set."""
        if not self.stage_timeout_s:
            return None
        return Watchdog(self, self.stage_timeout_s)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call a registered method by name (same as `getattr(group, method)(...)`)."""
        if method not in self.specs:
            raise AttributeError(
                f"{self.worker_cls.__name__}.{method} is not registered; known: {sorted(self.specs)}"
            )
        return getattr(self, method)(*args, **kwargs)

    def view(self, role: str) -> Any:
        """The WorkerGroup-like view of one role of a fused (colocated) group."""
        from rayrl.controller.colocate import RoleView

        return RoleView(self, role)

    # --- health and replacement ---------------------------------------------------------

    def check_health(self, timeout_s: float = 5.0) -> HealthReport:
        """Heartbeat every rank; ranks that died or stay silent `timeout_s` are reported.

        Ranks being replaced, or replaced while the check ran, are listed as
        `replacing`, never as failed: a check racing `replace` raises no false alarm."""
        return check_group(self, timeout_s)

    def usage(self, timeout_s: float = 10.0, reset: bool = True) -> list[dict[str, Any]]:
        """Each rank's resource use per stage since the last call (`controller.usage`);
        a rank that does not answer within `timeout_s` gives an empty report."""
        pending = {r: a._rayrl_usage.remote(reset) for r, a in enumerate(self.actors) if a}
        results, _ = wait_all(pending, timeout_s)
        return [results.get(r, {"stages": {}}) for r in range(self.world_size)]

    @overload
    def replace(self, rank: int, timeout_s: float = ..., retries: int = ...) -> Replacement: ...

    @overload
    def replace(
        self, rank: Sequence[int], timeout_s: float = ..., retries: int = ...
    ) -> list[Replacement]: ...

    def replace(
        self, rank: int | Sequence[int], timeout_s: float = 120.0, retries: int = 0
    ) -> Replacement | list[Replacement]:
        """Start a new worker for `rank` (or each of several ranks: all those of a lost
        node in one call, so the group re-forms once), run its init, re-form the process
        group on all ranks under a new generation and rebuild the survivors' engines.

        A rank still alive (a hung one) is killed first. Survivors still inside a call
        after `abort_grace_s` are replaced too. A new actor goes into its old bundle when
        that bundle's node is alive, otherwise into a spare bundle of the pool
        (TopologyChangedWarning names both nodes). The state is not restored: see
        `rayrl.controller.recovery.GroupSnapshot`.
        """
        ranks = [rank] if isinstance(rank, int) else sorted(set(rank))
        bad = [r for r in ranks if not 0 <= r < self.world_size]
        if not ranks or bad:
            raise IndexError(
                f"{self.name} has ranks 0..{self.world_size - 1}; cannot replace {bad or ranks}"
            )
        done = {d.rank: d for d in bring_up(self, set(ranks), timeout_s, retries, "replace")}
        if isinstance(rank, int):
            return done[rank]
        return [done[r] for r in sorted(done)]

    def add_call_hook(
        self, hook: CallHook, *, new_workers: bool = True, timeout_s: float = 30.0
    ) -> None:
        """Install `hook` (see `rayrl.controller.calls`) in every worker running now,
        busy or not, and, with `new_workers`, in every worker the group starts later
        (replacements, init retries). Each process runs its own copy of the hook."""
        if new_workers:
            self.call_hooks.append(hook)
        with self.lock:
            actors = [a for a in self.actors if a is not None]
        ray.get([a._rayrl_add_call_hooks.remote([hook]) for a in actors], timeout=timeout_s)

    # --- teardown -----------------------------------------------------------------------

    def _kill(self, rank: int) -> None:
        with self.lock:
            actor = self.actors[rank]
            self.actors[rank] = None
        if actor is not None:
            with contextlib.suppress(Exception):  # already gone is fine
                ray.kill(actor, no_restart=True)

    def shutdown(self) -> None:
        """Kill every worker of the group and delete its discovery keys (idempotent).
        Bundles stay with their pool."""
        for rank in range(len(self.actors)):
            self._kill(rank)
        if self.backend:
            self._drop_discovery_keys()

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # --- errors -------------------------------------------------------------------------

    def _raise(
        self,
        error: type[WorkerError],
        stage: str,
        failures: dict[int, Any],
        timeout_s: float,
        attempts: int = 1,
        cleanup: bool = False,
    ) -> None:
        """Raise `error` for the most telling failed rank: a dead one, else one that
        raised (its own cause: a backend's "connectFullMesh failed" tells more than its
        peer's timeout waiting for it), else the lowest.

        With `cleanup`, the group's actors are killed after the error is composed (a
        hanging actor is probed for its pid and log file first).
        """
        rank = min(failures, key=lambda r: _telling(failures[r], r))
        cause = failures[rank]
        worker = self.describe(rank)
        if isinstance(cause, TimeoutError) and not isinstance(cause, ray.exceptions.RayError):
            worker, state = self._probe(rank, worker)
            cause = timeout_text(error.phase, stage, timeout_s, worker, state)
        others = sorted(set(failures) - {rank})
        hint = failure_hint(error.phase, cause, attempts)
        if others:
            hint += f"; ranks {others} failed too"
        exc = error(stage, worker, cause, hint)
        if cleanup:
            self.shutdown()
        if isinstance(cause, BaseException):
            raise exc from cause
        raise exc

    def _probe(self, rank: int, worker: WorkerDescription) -> tuple[WorkerDescription, str]:
        """Ask the GCS what became of rank's actor: its state, and pid/log if it started."""
        actor = self.actors[rank]
        if actor is None:
            return worker, ""
        try:
            row = ray_private.actor_row(actor)
        except Exception:  # noqa: BLE001 - a private API; the message just says less
            return worker, ""
        pid = row["pid"] or None
        if pid and worker.pid is None:
            node = row["node_id"] or worker.node_id
            worker = dataclasses.replace(
                worker, pid=pid, node_id=node, log_file=worker.log_file or find_log_file(pid)
            )
        return worker, row["state"]


def _telling(cause: Any, rank: int) -> tuple[bool, bool, int]:
    """Sort key of a rank's failure, most telling first: dead, then an error of its own,
    then a timeout (no answer, or a wait of its own that timed out)."""
    return (not isinstance(cause, DEAD_ERRORS), isinstance(cause, TimeoutError), rank)
