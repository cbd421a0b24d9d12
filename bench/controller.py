"""Controller overheads: a no-op call on a 4-worker group, KV put-to-wake-up latency, and a
DP_SPLIT round trip of a 1024 x 1024-token Batch against raw Ray moving the same bytes.

Prints one JSON object per line (bench, metric, value, unit, and target/better where the
issue sets one). Starts its own local Ray (4 CPUs, no dashboard); never attaches to
another cluster. Usage: `python bench/controller.py [--calls 500] [--rounds 15]`.

`dispatch_vs_raw_ratio` compares, in the same run and alternating:
- dispatch: `group.identity(batch)` (pad, chunk into 4, one chunk per worker, each
  returns its chunk, concatenate, unpad);
- raw: the same tokens as a numpy array (Ray's fastest, zero-copy path; a torch view
  would pickle its whole storage) cut into 4, `ray.put` of each piece, the same 4
  actors return their piece, `ray.get` and `np.concatenate` on the driver.
Both move the same bytes along the same path, so the ratio is rayrl's own overhead.
`dispatch_vs_driver_putget_ratio` (no target) compares with a bare `ray.get(ray.put(x))`
of the numpy array on the driver, which moves the bytes through no worker at all.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid

import numpy as np
import ray
import torch

from rayrl.batch import Batch
from rayrl.cluster.kv import KVStore, kv_latency
from rayrl.cluster.pool import PoolSpec, ResourcePool
from rayrl.controller import DP_SPLIT, ONE_TO_ALL, Worker, WorkerGroup, register

BENCH = "controller"


class BenchWorker(Worker):
    """Does nothing, fast: the cost measured is the controller's."""

    @register(dispatch=ONE_TO_ALL)
    def noop(self) -> None:
        return None

    @register(dispatch=DP_SPLIT)
    def identity(self, batch: Batch) -> Batch:
        return batch

    def echo(self, array: np.ndarray) -> np.ndarray:
        return array


def emit(metric: str, value: float, unit: str, target: float | None = None, **extra) -> None:
    line = {"bench": BENCH, "metric": metric, "value": round(value, 4), "unit": unit}
    if target is not None:
        line.update(target=target, better="lower")
    line.update(extra)
    print(json.dumps(line), flush=True)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def bench_noop(group: WorkerGroup, calls: int) -> None:
    for _ in range(50):
        group.noop()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        group.noop()
        times.append((time.perf_counter() - t0) * 1e3)
    emit("noop_call_p50_ms", percentile(times, 50), "ms", target=5, n=calls, world_size=4)
    emit("noop_call_p99_ms", percentile(times, 99), "ms", n=calls, world_size=4)


def bench_kv(run: str, n: int) -> None:
    kv = KVStore.create(run)
    try:
        kv_latency(kv, n=20)  # warm-up
        stats = kv_latency(kv, n=n)
    finally:
        kv.shutdown()
    emit(
        "kv_wait_p50_ms", stats["kv_wait_p50_ms"], "ms", target=2, n=n, what="put to waiter wake-up"
    )
    emit("kv_wait_p99_ms", stats["kv_wait_p99_ms"], "ms", n=n, what="put to waiter wake-up")
    for name in ("put", "get"):
        emit(f"kv_{name}_p50_ms", stats[f"kv_{name}_p50_ms"], "ms", n=n)
        emit(f"kv_{name}_p99_ms", stats[f"kv_{name}_p99_ms"], "ms", n=n)


def bench_dispatch(group: WorkerGroup, rounds: int) -> None:
    tokens = torch.randint(0, 32000, (1024, 1024), dtype=torch.int64)
    batch = Batch.from_dict({"input_ids": tokens})
    actors = group.actors

    def dispatch() -> None:
        out = group.identity(batch)
        assert len(out) == 1024

    array = tokens.numpy()

    def raw() -> None:
        refs = [ray.put(piece) for piece in np.array_split(array, len(actors))]
        parts = ray.get([a.echo.remote(r) for a, r in zip(actors, refs, strict=True)])
        out = torch.from_numpy(np.concatenate(parts))
        assert out.shape[0] == 1024

    def putget() -> None:
        assert ray.get(ray.put(array)).shape[0] == 1024

    times: dict[str, list[float]] = {"dispatch": [], "raw": [], "putget": []}
    fns = {"dispatch": dispatch, "raw": raw, "putget": putget}
    for i in range(rounds + 3):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if i >= 3:  # the first rounds warm up the workers and the object store
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    mib = tokens.numel() * tokens.element_size() / 2**20
    emit("dispatch_ms", med["dispatch"], "ms", rounds=rounds, mib=mib)
    emit("raw_actor_putget_ms", med["raw"], "ms", rounds=rounds, mib=mib)
    emit("driver_putget_ms", med["putget"], "ms", rounds=rounds, mib=mib)
    emit("dispatch_vs_raw_ratio", med["dispatch"] / med["raw"], "x", target=1.5, rounds=rounds)
    emit("dispatch_vs_driver_putget_ratio", med["dispatch"] / med["putget"], "x", rounds=rounds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500, help="no-op calls timed")
    parser.add_argument("--kv", type=int, default=200, help="KV put/wait rounds timed")
    parser.add_argument("--rounds", type=int, default=15, help="Batch round trips timed")
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    run = f"bench-{uuid.uuid4().hex[:6]}"
    pool = ResourcePool(PoolSpec("bench", [4], {"CPU": 0.5}), run=run)
    try:
        group = WorkerGroup(BenchWorker, pool.bootstrap(timeout_s=60), role="bench", run=run)
        group.create(timeout_s=120)
        bench_noop(group, args.calls)
        bench_kv(run, args.kv)
        bench_dispatch(group, args.rounds)
        group.shutdown()
    finally:
        pool.teardown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
