"""Toy workers for the controller tests (imported by Ray workers, so kept in tests/).

torch and Batch are imported inside the methods that use them: a worker process that
never sees a Batch then never pays for importing torch (seconds on a loaded machine).
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from pathlib import Path
from typing import Any

import ray

from rayrl.controller import (
    ALL_TO_ALL,
    DP_SPLIT,
    ONE_TO_ALL,
    RANK_ZERO,
    CallPlan,
    Worker,
    WorkerGroup,
    register,
    register_collector,
    register_dispatch_mode,
)
from rayrl.controller.pending import Pending
from rayrl.controller.worker import HEALTH_GROUP


def _odd_ranks(world_size: int, args: tuple, kwargs: dict) -> CallPlan:
    """A custom mode: only odd ranks are called, with the same arguments."""
    per = [args if r % 2 else None for r in range(world_size)]
    return CallPlan(per, [kwargs if r % 2 else None for r in range(world_size)])


def _sum(outputs: list, state) -> int:
    return sum(outputs)


register_dispatch_mode("odd_ranks", _odd_ranks, _sum)
register_collector("max_of", lambda outputs, state: max(outputs))


def _trace_load(path: str):
    """Unpickling a Tracer appends this process's pid to `path`."""
    with open(path, "a") as f:
        f.write(f"{os.getpid()}\n")
    return Tracer(path)


class Tracer:
    """An object that records, in a file, every process that deserialises it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return _trace_load, (self.path,)


class Pickled:
    """Counts how often this process pickles it (the driver, for a group call's argument)."""

    count = 0

    def __reduce__(self):
        Pickled.count += 1
        return Pickled, ()


class Echo(Worker):
    """Every dispatch mode on simple values."""

    @register(dispatch=ONE_TO_ALL)
    def whoami(self) -> dict:
        return {"rank": self.rank, "pid": os.getpid(), "local_rank": self.local_rank}

    @register(dispatch=ALL_TO_ALL)
    def add(self, x: int, y: int = 0) -> int:
        return x + y + 100 * self.rank

    @register(dispatch=DP_SPLIT)
    def double(self, batch, factor: int = 2):
        import torch

        from rayrl.batch import Batch

        out = Batch.from_dict(
            {"x": batch["x"] * factor, "rank": torch.full((len(batch),), self.rank)},
            meta=batch.meta,
        )
        return out

    @register(dispatch=DP_SPLIT)
    def sample(self, batch, n: int):
        return batch.repeat(n)

    @register(dispatch=DP_SPLIT, collect="list")
    def sizes(self, batch, extra=None) -> int:
        return len(batch)

    @register(dispatch=RANK_ZERO)
    def first(self, x):
        return (self.rank, x)

    @register(dispatch=ONE_TO_ALL)
    def echo(self, x):
        return x

    @register(dispatch=ONE_TO_ALL)
    def boom(self, rank: int) -> int:
        if self.rank == rank:
            raise ValueError(f"boom on rank {rank}")
        return self.rank

    @register(dispatch=ONE_TO_ALL, collect="max_of")
    def rank_max(self) -> int:
        return self.rank

    @register(dispatch="odd_ranks")
    def rank_plus(self, x: int) -> int:
        return self.rank + x

    @register(dispatch=ONE_TO_ALL, blocking=False)
    def later(self, x: int) -> int:
        return x * 10

    @register(dispatch=ONE_TO_ALL)
    def nap(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    @register(dispatch=ONE_TO_ALL)
    def noop(self) -> None:
        return None

    # Producers and consumers for the future-passing matrix.
    @register(dispatch=ONE_TO_ALL)
    def make(self, n: int):
        import torch

        from rayrl.batch import Batch

        return Batch.from_dict({"x": torch.arange(n) + 100 * self.rank})

    @register(dispatch=RANK_ZERO)
    def make_first(self, n: int):
        return self.make(n)

    @register(dispatch=ONE_TO_ALL)
    def see(self, x):
        return summary(x)

    @register(dispatch=ALL_TO_ALL)
    def see_each(self, x):
        return summary(x)

    @register(dispatch=RANK_ZERO)
    def see_first(self, x):
        return summary(x)

    @register(dispatch=DP_SPLIT)
    def see_split(self, x):
        import torch

        from rayrl.batch import Batch

        if isinstance(x, Batch):
            return Batch.from_dict({"x": x["x"], "rank": torch.full((len(x),), self.rank)})
        return summary(x)

    @register(dispatch="odd_ranks", collect="list")
    def see_odd(self, x):
        return summary(x)


def summary(value):
    """A plain, comparable description of a value (Batches by their columns)."""
    if hasattr(value, "tensors"):
        return {"batch": {k: v.tolist() for k, v in value.tensors.items()}}
    if isinstance(value, (list, tuple)):
        return [summary(v) for v in value]
    return value


class Flaky(Worker):
    """init_worker fails on rank `bad_rank` the first `failures` times (counted in a file)."""

    def init_worker(
        self, marker: str = "", bad_rank: int = -1, failures: int = 0, fail_on: tuple = ()
    ) -> None:
        """Fails on calls number 0..failures-1 of rank `bad_rank`, and on those in `fail_on`."""
        if self.rank != bad_rank:
            return
        path = Path(marker)
        seen = int(path.read_text()) if path.exists() else 0
        path.write_text(str(seen + 1))
        if seen < failures or seen in fail_on:
            raise RuntimeError(f"init failure {seen + 1} of rank {self.rank} (pid {os.getpid()})")

    @register(dispatch=ONE_TO_ALL)
    def whoami(self) -> dict:
        return {"rank": self.rank, "pid": os.getpid()}


class SlowBeat(Worker):
    """A worker whose heartbeat takes `beat_s`: alive but silent when that is long."""

    def __init__(self, beat_s: float = 0.0) -> None:
        self.beat_s = beat_s

    @ray.method(concurrency_group=HEALTH_GROUP)
    def heartbeat(self) -> dict:
        time.sleep(self.beat_s)
        return super().heartbeat()

    @register(dispatch=ONE_TO_ALL)
    def whoami(self) -> dict:
        return {"rank": self.rank, "pid": os.getpid()}


class SlowStart(Worker):
    """A worker whose constructor hangs: the create phase must time out."""

    def __init__(self, seconds: float = 60.0) -> None:
        time.sleep(seconds)


@ray.remote(num_cpus=0.25)
class BundleHog:
    """Takes a bundle's CPU so that no worker can start in it."""

    def ready(self) -> bool:
        return True


class Dist(Worker):
    """A torch.distributed (gloo) worker: all-reduce and identity."""

    @register(dispatch=ONE_TO_ALL)
    def all_reduce(self, value: float | None = None) -> float:
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(self.rank + 1) if value is None else value])
        dist.all_reduce(t)
        return float(t.item())

    @register(dispatch=ONE_TO_ALL)
    def all_reduce_for(self, seconds: float, numel: int = 1 << 20) -> int:
        """All-reduce a tensor of `numel` floats again and again for `seconds`; how many."""
        import torch
        import torch.distributed as dist

        t, count, end = torch.ones(numel), 0, time.monotonic() + seconds
        while time.monotonic() < end:
            dist.all_reduce(t)
            count += 1
        return count

    @register(dispatch=ONE_TO_ALL)
    def visible_devices(self) -> str | None:
        import os

        return os.environ.get("CUDA_VISIBLE_DEVICES")

    @register(dispatch=ONE_TO_ALL)
    def whoami(self) -> dict:
        info = self.info()
        return {k: info[k] for k in ("rank", "pid", "node_id", "local_rank", "generation")}


class ShardedDist(Dist):
    """A gloo worker training a small FSDP2 model over the engine's hybrid mesh
    (`rayrl.train.mesh.TrainMesh`: ``[replicate, shard]`` sub-groups, not the default
    group), which lets go of its groups on a lost peer as the training engine does
    (`rayrl.train.group_release`)."""

    @register(dispatch=ONE_TO_ALL)
    def build(self, shard: int) -> None:
        import torch
        import torch.distributed as dist
        from torch import nn

        from rayrl.controller.collective_failure import on_collective_failure
        from rayrl.train.fsdp import shard_model
        from rayrl.train.mesh import MeshSpec, TrainMesh

        torch.manual_seed(0)
        self.mesh = TrainMesh(MeshSpec(dist.get_world_size(), 1, shard), self.rank, "cpu")

        class Stack(nn.Module):  # its ModuleList's layers are what shard_model wraps
            def __init__(self) -> None:
                super().__init__()
                self.layers = nn.ModuleList(nn.Linear(256, 256) for _ in range(4))

            def forward(self, x):
                for layer in self.layers:
                    x = layer(x)
                return x

        self.model = shard_model(Stack(), "cpu", False, mesh=self.mesh.fsdp)
        self.optimizer = torch.optim.AdamW(self.model.parameters())
        on_collective_failure(self.release)

    def release(self) -> None:
        from rayrl.train.group_release import release_groups

        release_groups(self.model, [self.mesh.fsdp])

    @register(dispatch=ONE_TO_ALL)
    def train_for(self, seconds: float) -> int:
        """Forward, backward (FSDP's all-gathers and reduce-scatters on the mesh's
        groups) and optimizer steps for `seconds`; how many."""
        import torch

        count, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            self.model(torch.randn(64, 256)).sum().backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            count += 1
        return count


class LateRankZero(Dist):
    """Rank 0 joins the process group `delay_s` late: the other ranks wait for its master."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s

    def init_distributed(
        self, backend: str = "gloo", timeout: float = 60.0, pg_timeout=None
    ) -> None:
        if self.rank == 0:
            time.sleep(self.delay_s)
        super().init_distributed(backend, timeout, pg_timeout)


@contextlib.contextmanager
def echo_groups(prefix: str, sizes: list[int]):
    """Echo groups of `sizes` workers (0.25 CPU each) on the connected Ray, roles
    "a", "b", ...; shut down and their pool torn down afterwards."""
    run = f"{prefix}-{uuid.uuid4().hex[:6]}"
    pool = reserve(run, [sum(sizes)], {"CPU": 0.25})
    parts = pool.split(sizes)
    made = [WorkerGroup(Echo, part, role=chr(97 + i), run=run) for i, part in enumerate(parts)]
    try:
        for group in made:
            group.create(timeout_s=120)
        yield made
    finally:
        for group in made:
            group.shutdown()
        pool.teardown()


def reserve(run: str, per_node: list[int], bundle: dict, **spec_kwargs):
    """Reserve a ResourcePool named `run`/w and return it (the caller tears it down)."""
    from rayrl.cluster.pool import PoolSpec, ResourcePool

    pool = ResourcePool(PoolSpec("w", per_node, bundle, **spec_kwargs), run=run)
    pool.bootstrap(timeout_s=30)
    return pool


class Progressing(Worker):
    """Long calls for the watchdog: one that reports progress, one that does not."""

    @register(dispatch=ONE_TO_ALL)
    def ticking(self, seconds: float) -> int:
        from rayrl import progress

        end = time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(0.1)
            progress.tick(items=1)
        return self.rank

    @register(dispatch=ONE_TO_ALL)
    def work(self) -> int:
        return os.getpid()


def _slow_state(value: int) -> SlowState:
    return SlowState(value, 0.0)


class SlowState:
    """A snapshot whose pickling (its copy into the object store) takes ``delay`` s."""

    def __init__(self, value: int, delay: float) -> None:
        self.value, self.delay = value, delay

    def __reduce__(self):
        time.sleep(self.delay)
        return _slow_state, (self.value,)


class Stateful(Worker):
    """A value to snapshot and restore, handed to the object store slowly."""

    def init_worker(self, delay: float = 0.0) -> None:
        self.value, self.delay = 0, delay

    @register(dispatch=ONE_TO_ALL)
    def set(self, value: int) -> None:
        self.value = value

    @register(dispatch=ONE_TO_ALL)
    def get(self) -> dict:
        return {"value": self.value, "pid": os.getpid()}

    @register(dispatch=ONE_TO_ALL)
    def slow_down(self, delay: float) -> None:
        """The snapshots taken from now on take `delay` s to reach the object store."""
        self.delay = delay

    def snapshot_state(self) -> SlowState:
        return SlowState(self.value, self.delay)

    def restore_state(self, state: SlowState) -> None:
        self.value = state.value


class Filling(Stateful):
    """A value whose snapshot is filled in ``delay`` s after `snapshot_state` returned
    (as a GPU's copies arrive in host memory behind the call): a `Pending`."""

    def snapshot_state(self) -> Pending:
        import threading

        box, filled, value = {"value": None}, threading.Event(), self.value

        def fill() -> None:
            time.sleep(self.delay)
            box["value"] = value
            filled.set()

        threading.Thread(target=fill, daemon=True).start()
        return Pending(box, filled.wait)

    def restore_state(self, state: dict) -> None:
        self.value = state["value"]


class Weighty(Worker):
    """A value whose snapshot is big enough (512 KiB) to live in its node's object store,
    not inline with its owner."""

    def init_worker(self) -> None:
        self.value = 0

    @register(dispatch=ONE_TO_ALL)
    def set(self, value: int) -> None:
        self.value = value

    @register(dispatch=ONE_TO_ALL)
    def get(self) -> int:
        return self.value

    def snapshot_state(self) -> Any:
        import numpy as np

        return np.full(1 << 16, self.value, dtype=np.float64)

    def restore_state(self, state: Any) -> None:
        self.value = int(state[0])


class Tally:
    """A driver-side part that a step changes."""

    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]
