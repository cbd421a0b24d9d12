"""Worker: the base class of every process a WorkerGroup runs, one per reserved bundle.

A Worker knows where it stands (group, role, rank, world size, local rank, node, pid,
Ray log file) and how to join its group's `torch.distributed` process group through
KV discovery, so no MASTER_ADDR/MASTER_PORT is needed. Subclasses override
`init_worker(**kwargs)` for their one-time setup (model load) and mark the methods a
group may call with `@register` (see `rayrl.controller.dispatch`). Each call enters the
worker through `rayrl.controller.calls`: it is marked busy (heartbeat, watchdog, usage
sampler) and runs the call hooks installed in the process; a subclass's registered
methods are wrapped for it once, when the class is defined (`__init_subclass__`).

The group creates the actor, then hands it a WorkerContext (`_rayrl_setup`); the
constructor is free for the subclass's own arguments. The group, not the subclass,
forms the process group (`_rayrl_join`, before `init_worker`, so FSDP finds it).
`ping`, `heartbeat` and `_rayrl_stack` run on their own thread, so a health check is
answered while a long call is running, with how long that call has made no progress
(`rayrl.progress`) and, asked for, the Python stack of the thread running it.

Three hooks make a worker recoverable at step boundaries (`rayrl.controller.recovery`):
`snapshot_state()` returns this rank's state (its shard when sharded),
`restore_state(state)` puts it back, and `rebuild()` rebuilds whatever was bound to
the previous process group (device mesh, FSDP wrapping, communicators) after the group
re-formed; by default it runs `init_worker` again with the same arguments. A worker
started in place of a lost rank while the others kept their state runs `init_worker`
with `joining` True: it must run the same collectives as their `rebuild`, and may
leave its state to the restore that follows. What `init_worker` and `rebuild` read
from storage (`rayrl.reads`) comes back in `info()["bytes_read"]`.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, cast

import ray

from rayrl import reads
from rayrl.cluster import ray_private
from rayrl.cluster.kv import KVStore
from rayrl.controller import calls
from rayrl.controller.calls import hooked, running
from rayrl.controller.pending import settled
from rayrl.controller.wire import set_wire_for_cluster

logger = logging.getLogger("rayrl.controller")

HEALTH_GROUP = "rayrl_health"
# the thread that hands a captured snapshot to the object store beside the next calls
SNAPSHOT_GROUP = "rayrl_snapshot"
# calls that may run several at once on one worker (a rollout replica's: they share its
# engine's batch); `@register(..., options={"concurrency_group": CALLS_GROUP})`
CALLS_GROUP = "rayrl_calls"
# a worker actor's threads besides its calls' own: one each, and CALLS_GROUP's
CONCURRENCY_GROUPS = {HEALTH_GROUP: 1, SNAPSHOT_GROUP: 1, CALLS_GROUP: 8}


@dataclass(frozen=True)
class WorkerContext:
    """Where a worker stands in its group; sent by the WorkerGroup at create and reform."""

    group: str
    role: str
    rank: int
    world_size: int
    local_rank: int = 0
    local_world_size: int = 1
    run: str = ""
    kv: KVStore | None = None
    generation: int = 0
    scope: str = ""  # discovery keys live under it: unique to one WorkerGroup object
    usage_interval_s: float = 0.5  # resource-usage sampling period (0 disables it)
    num_cpus: float = 0.0  # CPUs of the worker's bundle (0: unknown, threads left as they are)
    num_gpus: float = 0.0  # GPUs of the worker's bundle (0: the process sees none)


def ray_log_file() -> str:
    """Path of this process's Ray log (stderr) file, or "" when Ray is not logging to files."""
    return ray_private.current_log_file()


def find_log_file(pid: int) -> str:
    """The Ray log (stderr) file of worker process `pid`, if it is on this machine."""
    return ray_private.log_file_of(pid)


class Worker:
    """Base class for a group's workers. Knows its place; joins the process group.

    Attributes available after the group's create phase: `group`, `role`, `rank`,
    `world_size`, `local_rank`, `local_world_size`, `run`, `kv`, `generation`,
    `node_id`, `pid`, `log_file`.
    """

    ctx: WorkerContext | None = None
    # init_worker runs in place of a lost rank while the group's other ranks kept their
    # state (they rebuild, see the module docstring); set by the group, before it runs
    joining: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        calls.track(cls)  # each registered method's calls run inside calls.running

    # --- set by the group ---------------------------------------------------------------

    def _rayrl_setup(self, ctx: WorkerContext, call_hooks: tuple[Any, ...] = ()) -> dict[str, Any]:
        """Receive this worker's context and install the group's call hooks in this
        process (create phase); returns `info()`."""
        self.ctx = ctx
        self._rayrl_busy: tuple[str, float, int] | None = None
        if ctx.num_gpus == 0:
            hide_gpus(ctx)
        set_wire_for_cluster()
        if ctx.num_cpus > 0:
            use_cpus(ctx.num_cpus)
        if ctx.usage_interval_s > 0:
            from rayrl.controller.usage import process_sampler

            process_sampler(ctx.usage_interval_s).track(self)
        calls.add_call_hooks(call_hooks)
        _announce_log_prefix(f"{ctx.role} rank {ctx.rank}")
        return self.info()

    def _rayrl_set_context(self, ctx: WorkerContext) -> dict[str, Any]:
        """Update rank, local rank or generation after a replacement elsewhere."""
        self.ctx = ctx
        return self.info()

    def _rayrl_init(self, kwargs: dict[str, Any], joining: bool = False) -> dict[str, Any]:
        """Run `init_worker(**kwargs)` (init phase; `joining`: see the class attribute);
        returns `info()`, with what it read from storage."""
        self._rayrl_init_kwargs = dict(kwargs)
        self.joining = joining
        start, before = time.time(), reads.total()
        try:
            with running(self, "init_worker"):
                self.init_worker(**kwargs)
        finally:
            self._rayrl_init_span = (start, time.time())
            self._rayrl_bytes_read = reads.total() - before
        return self.info()

    def _rayrl_join(
        self, ctx: WorkerContext, backend: str, timeout: float, pg_timeout: float | None = None
    ) -> dict[str, Any]:
        """Leave the current process group and join generation `ctx.generation`."""
        self.ctx = ctx
        with running(self, "init_distributed"):
            self.destroy_distributed()
            self.init_distributed(backend, timeout=timeout, pg_timeout=pg_timeout)
        return self.info()

    def _rayrl_rebuild(self) -> dict[str, Any]:
        """After the process group re-formed: rebuild what was bound to the old one."""
        before = reads.total()
        try:
            with running(self, "rebuild"):
                self.rebuild()
        finally:
            self._rayrl_bytes_read = reads.total() - before
        return self.info()

    def _rayrl_snapshot(self) -> int:
        """Capture this rank's state at a step boundary (`snapshot_state`) for
        `_rayrl_snapshot_publish`; returns the rank."""
        with running(self, "snapshot"):
            self._rayrl_captured = self.snapshot_state()
            return self.ctx.rank if self.ctx else 0

    @ray.method(concurrency_group=SNAPSHOT_GROUP)  # type: ignore[untyped-decorator]  # ray is not followed
    def _rayrl_snapshot_publish(self) -> tuple[int, Any]:
        """(rank, the state `_rayrl_snapshot` captured), on a thread of its own: called
        with two returns, so the driver owns the state without fetching it, while Ray
        copies it into the object store beside the next step's calls (`snapshot_state`
        may return host buffers that its next call overwrites: the driver waits for
        this before the next capture). A state still being copied from the device
        (`rayrl.controller.pending`) is waited for here, off the worker's main thread."""
        with hooked(self, "snapshot_publish"):  # not busy: the next calls run beside it
            state, self._rayrl_captured = getattr(self, "_rayrl_captured", None), None
            return self.ctx.rank if self.ctx else 0, settled(state)

    def _rayrl_snapshot_nbytes(self) -> int:
        with running(self, "snapshot size"):
            return int(self.snapshot_nbytes())

    def _rayrl_restore(self, state: Any) -> None:
        """Put back what `_rayrl_snapshot` returned."""
        with running(self, "restore"):
            self.restore_state(state)

    def _rayrl_restore_from(self, copies: list[Any]) -> int:
        """Put back the first of `copies` (ObjectRefs of one rank's snapshot: the
        primary, then its replicas on other nodes) that is still there; returns its
        index. Raises the last copy's error when none is."""
        with running(self, "restore"):
            for index, ref in enumerate(copies):
                try:
                    state = ray.get(ref)
                except (ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError):
                    if index == len(copies) - 1:
                        raise
                    continue
                self.restore_state(state)
                return index
            raise ValueError("_rayrl_restore_from needs at least one copy")

    @ray.method(concurrency_group=HEALTH_GROUP)  # type: ignore[untyped-decorator]  # ray is not followed
    def _rayrl_add_call_hooks(self, hooks: list[Any]) -> int:
        """Install call hooks in this process (`rayrl.controller.calls`), on the health
        thread so that a busy worker takes them too; returns how many are installed."""
        return calls.add_call_hooks(hooks)

    @ray.method(concurrency_group=HEALTH_GROUP)  # type: ignore[untyped-decorator]  # ray is not followed
    def _rayrl_trace(self, window: Any) -> list[str]:
        """Arm `window` (a `tracing.TraceWindow`: trace the calls it names), or with
        None disarm it: the trace files written since it was armed."""
        from rayrl.controller import tracing

        if window is None:
            return tracing.disarm()
        tracing.arm(window)
        return []

    # --- for subclasses -----------------------------------------------------------------

    def init_worker(self, *args: Any, **kwargs: Any) -> None:
        """One-time setup after placement (load a model, build an optimizer). No-op here.
        A subclass takes the arguments of its own (the group passes them as keywords);
        mypy lets an override of this ``*args, **kwargs`` signature narrow them.

        With a backend, the group formed the process group before this runs."""

    def rebuild(self) -> None:
        """Rebuild what depends on the process group after it re-formed (a rank of the
        group was replaced). The state is restored afterwards, from a snapshot or a
        checkpoint. By default: `init_worker` again, with the same arguments."""
        self.init_worker(**getattr(self, "_rayrl_init_kwargs", {}))

    def snapshot_state(self) -> Any:
        """This rank's state to come back to (None: nothing worth keeping). It may hold
        buffers that the next call overwrites (it is copied out before then), and
        `rayrl.controller.pending.Pending` values still being filled from the device."""
        return None

    def restore_state(self, state: Any) -> None:
        """Put back a `snapshot_state()` of this rank (of this or an earlier process)."""

    def snapshot_nbytes(self) -> int:
        """About how many bytes `snapshot_state()` returns (0: nothing, or small)."""
        return 0

    @classmethod
    def check_init_kwargs(cls, kwargs: dict[str, Any]) -> None:
        """Reject bad `init_worker` arguments on the driver, before any worker runs."""

    def init_distributed(
        self, backend: str = "gloo", timeout: float = 60.0, pg_timeout: float | None = None
    ) -> None:
        """Join this group's torch.distributed process group through KV discovery.

        Rank 0 publishes its address under this group's current generation; the other
        ranks wait for it. A later generation (after a replacement) forms a new group.
        The keys live under the group's discovery scope, unique to its WorkerGroup
        object, so a group re-created under the same run and role never reads them.
        `pg_timeout` bounds every later collective (torch's default when None).
        """
        from rayrl.cluster.discovery import init_process_group

        ctx = self._require_ctx("init_distributed")
        if ctx.kv is None:
            raise RuntimeError(
                f"{ctx.role} rank {ctx.rank}: init_distributed needs a KVStore; "
                "pass kv=KVStore.create(run) to the WorkerGroup"
            )
        init_process_group(
            ctx.kv,
            group=ctx.scope or ctx.group,
            rank=ctx.rank,
            world_size=ctx.world_size,
            backend=backend,
            generation=ctx.generation,
            timeout=timeout,
            pg_timeout=pg_timeout,
        )

    def destroy_distributed(self) -> None:
        """Leave the default process group, if this process is in one."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

    # --- health and introspection -------------------------------------------------------

    @ray.method(concurrency_group=HEALTH_GROUP)  # type: ignore[untyped-decorator]  # ray is not followed
    def ping(self) -> int:
        """Answer a health check (on its own thread); returns this worker's rank."""
        return self.ctx.rank if self.ctx else -1

    def _rayrl_busy_now(self) -> tuple[str, float, int] | None:
        """(method, start time, thread id) of the call this worker is in, or None."""
        return getattr(self, "_rayrl_busy", None)

    @ray.method(concurrency_group=HEALTH_GROUP)  # type: ignore[untyped-decorator]  # ray is not followed
    def heartbeat(self) -> dict[str, Any]:
        """Liveness and what the worker is doing: the method it is in, for how long, and
        for how long that call has made no progress (`idle_s`, see `rayrl.progress`)."""
        from rayrl import progress

        busy = self._rayrl_busy_now()
        now = time.time()
        moved = progress.state()
        return {
            "rank": self.ctx.rank if self.ctx else -1,
            "pid": os.getpid(),
            "time": now,
            "busy": busy[0] if busy else None,
            "busy_s": now - busy[1] if busy else 0.0,
            "idle_s": min(moved["idle_s"], now - busy[1]) if busy else 0.0,
            "phase": moved["phase"] if busy else None,
            "progress": moved["counts"] if busy else {},
        }

    @ray.method(concurrency_group=HEALTH_GROUP)  # type: ignore[untyped-decorator]  # ray is not followed
    def _rayrl_stack(self) -> str:
        """The Python stack of the thread running this worker's current call ("" if idle)."""
        busy = self._rayrl_busy_now()
        if not busy or len(busy) < 3:
            return ""
        frame = sys._current_frames().get(busy[2])
        if frame is None:
            return ""
        return f"Thread {busy[2]} in {busy[0]}:\n" + "".join(traceback.format_stack(frame))

    @ray.method(concurrency_group=HEALTH_GROUP)  # type: ignore[untyped-decorator]  # ray is not followed
    def _rayrl_usage(self, reset: bool = True) -> dict[str, Any]:
        """This process's resource use per stage since the last call (see controller.usage)."""
        from rayrl.controller import usage

        calls = usage.take_calls(reset)
        if usage._SAMPLER is None:
            return {"stages": {}, "max_memory_allocated_gb": None, "num_cpus": 0.0, "calls": calls}
        return {**usage._SAMPLER.report(reset=reset), "calls": calls}

    def debugger_state(self) -> dict[str, Any]:
        """Whether Ray's debugger is on in this process: mode, post-mortem, breakpoint hook."""
        import sys

        from ray.util import rpdb

        hook = sys.breakpointhook
        return {
            "RAY_DEBUG": os.environ.get("RAY_DEBUG", "1"),
            "post_mortem": rpdb._is_ray_debugger_post_mortem_enabled(),
            "breakpoint": os.environ.get("PYTHONBREAKPOINT", ""),
            "breakpointhook": f"{getattr(hook, '__module__', '?')}.{getattr(hook, '__name__', '?')}",
        }

    def __repr__(self) -> str:
        ctx = self.ctx
        return f"{ctx.role} rank {ctx.rank}" if ctx else type(self).__name__

    def info(self) -> dict[str, Any]:
        """Where this worker runs: group, role, ranks, node, host, pid, log file, distributed."""
        ctx = self.ctx or WorkerContext(group="", role="", rank=-1, world_size=0)
        return {
            "group": ctx.group,
            "role": ctx.role,
            "rank": ctx.rank,
            "world_size": ctx.world_size,
            "local_rank": ctx.local_rank,
            "generation": ctx.generation,
            "node_id": self.node_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "log_file": self.log_file,
            "distributed": _distributed_initialized(),
            "threads": _torch_threads(),
            "init_span": getattr(self, "_rayrl_init_span", None),  # wall clock, last init
            # read from storage by the last init_worker or rebuild (rayrl.reads)
            "bytes_read": getattr(self, "_rayrl_bytes_read", 0),
        }

    # --- convenience attributes ---------------------------------------------------------

    def _require_ctx(self, what: str) -> WorkerContext:
        if self.ctx is None:
            raise RuntimeError(f"{what}: this worker has no context; create it with a WorkerGroup")
        return self.ctx

    @property
    def group(self) -> str:
        return self._require_ctx("group").group

    @property
    def role(self) -> str:
        return self._require_ctx("role").role

    @property
    def rank(self) -> int:
        return self._require_ctx("rank").rank

    @property
    def world_size(self) -> int:
        return self._require_ctx("world_size").world_size

    @property
    def local_rank(self) -> int:
        return self._require_ctx("local_rank").local_rank

    @property
    def local_world_size(self) -> int:
        return self._require_ctx("local_world_size").local_world_size

    @property
    def run(self) -> str:
        return self._require_ctx("run").run

    @property
    def kv(self) -> Any:
        return self._require_ctx("kv").kv

    @property
    def generation(self) -> int:
        return self._require_ctx("generation").generation

    @property
    def node_id(self) -> str:
        return cast(str, ray.get_runtime_context().get_node_id())

    @property
    def pid(self) -> int:
        return os.getpid()

    @property
    def log_file(self) -> str:
        if not hasattr(self, "_rayrl_log_file"):
            self._rayrl_log_file = ray_log_file()
        return self._rayrl_log_file


def _announce_log_prefix(name: str) -> None:
    """Make Ray prefix this process's output lines with `name` (e.g. "actor rank 0")
    on the driver, instead of the class name it read at actor creation, before the
    group told the worker its role and rank. Ray's log monitor takes a line starting
    with its actor-name marker as the new prefix (what Ray prints after __init__)."""
    import sys

    from rayrl.cluster import ray_private

    marker = ray_private.actor_name_marker()
    if marker is None:  # a Ray without the marker: keep its prefix
        return
    for stream in (sys.stdout, sys.stderr):
        print(f"{marker}{name}", file=stream, flush=True)


def hide_gpus(ctx: WorkerContext) -> None:
    """A worker whose bundle holds no GPU sees none. Ray leaves such a worker the
    devices its node's processes see, so on a GPU machine a CPU run's workers (or a CPU
    role beside GPU ones) would otherwise pick up a GPU nobody reserved for them."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        logger.warning(
            "%s rank %d: CUDA was initialised before the worker's setup, so its bundle's "
            "no-GPU setting cannot hide the GPUs any more; keep CUDA calls out of the "
            "worker's constructor",
            ctx.role,
            ctx.rank,
        )


def use_cpus(num_cpus: float) -> int:
    """Compute threads for a worker whose bundle holds `num_cpus` CPUs: that many (at
    least 1, at most the cores this process may run on), set deliberately rather than
    left to the environment (Ray's OMP_NUM_THREADS, a cluster's own setting). torch's
    intra-op pool is resized when torch is loaded; OMP/MKL variables cover torch loaded
    later and the processes the worker starts. Returns the thread count."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = max(1, min(int(num_cpus), cores or 1))
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[name] = str(threads)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(threads)
    return threads


def _torch_threads() -> int | None:
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else None


def _distributed_initialized() -> bool:
    import sys

    dist = sys.modules.get("torch.distributed")
    return bool(dist and dist.is_available() and dist.is_initialized())
