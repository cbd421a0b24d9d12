"""Controller and cluster-layer overheads, each compared side by side in one run.

Prints one JSON object per line (bench, metric, value, unit, and target/better where
the issue sets one). Starts its own local Ray (4 CPUs, no dashboard); never attaches
to another cluster. Usage: `python bench/controller.py [--calls 500] [--rounds 15]`.

Ratios are medians of per-round ratios, the two sides interleaved and their order
alternated each round, so that load drifting on a shared machine cancels out:

- `dispatch_vs_raw_ratio`: `group.identity(batch)` (pad, chunk into 4, one chunk per
  worker, each returns its chunk, concatenate, unpad) of a 1024 x 1024-token Batch,
  against the same tokens as a numpy array cut into 4, `ray.put` of each piece, the
  same 4 actors echoing their piece, `ray.get` and `np.concatenate`: rayrl's overhead;
- `broadcast_vs_put_once_ratio`: a ONE_TO_ALL call carrying 32 MiB to 4 workers,
  against one `ray.put` and the same ref passed to each actor;
- `kv_put_during_timeouts_ratio`: the p50 of KV puts made while 100 waits time out at
  once in a namespace of 10k keys, against the p50 of puts on the idle server.

Counts and one-shot figures: `kv_threads_at_start` (threads of a fresh KV server's
process), `fit_10k_bundles_s` (the fit check of a 10,000-bundle plan on 1,250 nodes,
pure Python, no Ray), no-op call and KV latency percentiles (observations on CPU).
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
from rayrl.cluster.guard import assess
from rayrl.cluster.inspect import ClusterState, NodeInfo
from rayrl.cluster.kv import KVStore, kv_latency
from rayrl.cluster.pool import PoolSpec, ResourcePool
from rayrl.controller import DP_SPLIT, ONE_TO_ALL, Worker, WorkerGroup, register

BENCH = "controller"


class BenchWorker(Worker):
    """Does nothing, fast: the cost measured is the controller's."""

    @register(dispatch=ONE_TO_ALL)
    def noop(self) -> None:
        return None

    @register(dispatch=ONE_TO_ALL)
    def take(self, array: np.ndarray) -> int:
        return int(array.nbytes)

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


def interleaved(fns: dict, rounds: int, warmup: int = 3) -> dict[str, list[float]]:
    """Seconds of each function per round, in an order that rotates every round."""
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(rounds + warmup):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            t0 = time.perf_counter()
            fns[name]()
            if i >= warmup:  # the first rounds warm up the workers and the object store
                times[name].append(time.perf_counter() - t0)
    return times


def median_ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


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
        pid = ray.get(kv._actor.__ray_call__.remote(lambda self: os.getpid()))
        threads = len(os.listdir(f"/proc/{pid}/task"))
        emit("kv_threads_at_start", threads, "threads", target=32, what="fresh KV server process")
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


def _fill(server, namespace: str, n: int) -> int:
    """Server-side: put `n` keys in `namespace` (a bench shortcut, not a client path)."""
    me = {"label": "bench fill"}
    for i in range(n):
        server.put((namespace, f"grp{i % 100}/gen{i // 100}/ranks/{i}", i, False, 8, me))
    return n


def _put_p50_ms(kv: KVStore, n: int, namespace: str) -> float:
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        kv.put(f"idle/{i}", i, namespace=namespace)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _put_p50_during_timeouts(kv: KVStore, namespace: str, waiters: int, timeout: float) -> float:
    """p50 of puts sent from just before `waiters` waits time out until all have returned."""
    refs = [
        kv._actor.wait.remote((namespace, f"missing/{i}/master", timeout)) for i in range(waiters)
    ]
    deadline = time.monotonic() + timeout
    while kv.stats()["pending_waiters"] < waiters:
        time.sleep(0.01)
    time.sleep(max(0.0, deadline - time.monotonic() - 0.2))
    times, i = [], 0
    while True:
        t0 = time.perf_counter()
        kv.put(f"busy/{i}", i, namespace=namespace)
        times.append(time.perf_counter() - t0)
        i += 1
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        if len(done) == len(refs) and len(times) >= 20:
            break
    assert all(status == "timeout" for status, _, _ in ray.get(refs))
    return statistics.median(times) * 1e3


def bench_kv_timeouts(run: str, rounds: int) -> None:
    kv = KVStore.create(run + "-big")
    namespace = "big"
    try:
        ray.get(kv._actor.__ray_call__.remote(_fill, namespace, 10_000))
        ratios, idle, busy = [], [], []
        for i in range(rounds):
            pair = [lambda: _put_p50_ms(kv, 100, namespace)]
            pair.append(lambda: _put_p50_during_timeouts(kv, namespace, 100, 1.0))
            first, second = pair if i % 2 == 0 else pair[::-1]
            a, b = first(), second()
            quiet, loaded = (a, b) if i % 2 == 0 else (b, a)
            idle.append(quiet)
            busy.append(loaded)
            ratios.append(loaded / quiet)
    finally:
        kv.shutdown()
    emit("kv_put_idle_p50_ms", statistics.median(idle), "ms", rounds=rounds)
    emit("kv_put_during_timeouts_p50_ms", statistics.median(busy), "ms", rounds=rounds)
    emit(
        "kv_put_during_timeouts_ratio",
        statistics.median(ratios),
        "x",
        target=2,
        rounds=rounds,
        waiters=100,
        keys=10_000,
    )


def bench_broadcast(group: WorkerGroup, rounds: int) -> None:
    array = np.random.default_rng(0).integers(0, 255, 32 * 2**20, dtype=np.uint8)
    actors = group.actors

    def broadcast() -> None:
        assert group.take(array) == [array.nbytes] * len(actors)

    def put_once() -> None:
        ref = ray.put(array)
        assert ray.get([a.take.remote(ref) for a in actors]) == [array.nbytes] * len(actors)

    times = interleaved({"broadcast": broadcast, "put_once": put_once}, rounds)
    emit("broadcast_ms", statistics.median(times["broadcast"]) * 1e3, "ms", mib=32, ranks=4)
    emit("put_once_ms", statistics.median(times["put_once"]) * 1e3, "ms", mib=32, ranks=4)
    emit(
        "broadcast_vs_put_once_ratio",
        median_ratio(times["broadcast"], times["put_once"]),
        "x",
        target=1.1,
        rounds=rounds,
    )


def bench_dispatch(group: WorkerGroup, rounds: int) -> None:
    tokens = torch.randint(0, 32000, (1024, 1024), dtype=torch.int64)
    batch = Batch.from_dict({"input_ids": tokens})
    actors = group.actors
    array = tokens.numpy()

    def dispatch() -> None:
        assert len(group.identity(batch)) == 1024

    def raw() -> None:
        refs = [ray.put(piece) for piece in np.array_split(array, len(actors))]
        parts = ray.get([a.echo.remote(r) for a, r in zip(actors, refs, strict=True)])
        assert torch.from_numpy(np.concatenate(parts)).shape[0] == 1024

    def putget() -> None:
        assert ray.get(ray.put(array)).shape[0] == 1024

    times = interleaved({"dispatch": dispatch, "raw": raw, "putget": putget}, rounds)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    mib = tokens.numel() * tokens.element_size() / 2**20
    emit("dispatch_ms", med["dispatch"], "ms", rounds=rounds, mib=mib)
    emit("raw_actor_putget_ms", med["raw"], "ms", rounds=rounds, mib=mib)
    emit("driver_putget_ms", med["putget"], "ms", rounds=rounds, mib=mib)
    emit(
        "dispatch_vs_raw_ratio",
        median_ratio(times["dispatch"], times["raw"]),
        "x",
        target=1.5,
        rounds=rounds,
    )
    emit(
        "dispatch_vs_driver_putget_ratio",
        median_ratio(times["dispatch"], times["putget"]),
        "x",
        rounds=rounds,
    )


def bench_fit() -> None:
    nodes = [
        NodeInfo(
            f"{i:056x}", "10.0.0.1", i == 0, {"GPU": 8.0, "CPU": 64.0}, {"GPU": 8.0, "CPU": 64.0}
        )
        for i in range(1250)
    ]
    cluster = ClusterState(nodes, [], {})
    plans = {
        "PACK": PoolSpec("p", [10_000], {"GPU": 1, "CPU": 4}, strategy="PACK"),
        "STRICT_PACK": PoolSpec("p", [8] * 1250, {"GPU": 1, "CPU": 4}),
    }
    worst = 0.0
    for strategy, spec in plans.items():
        t0 = time.perf_counter()
        verdict = assess([spec], cluster)
        seconds = time.perf_counter() - t0
        assert verdict.status == "fits", verdict.reason
        emit(f"fit_10k_bundles_{strategy.lower()}_s", seconds, "s", bundles=10_000, nodes=1250)
        worst = max(worst, seconds)
    emit("fit_10k_bundles_s", worst, "s", target=1, bundles=10_000, nodes=1250, what="slowest plan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500, help="no-op calls timed")
    parser.add_argument("--kv", type=int, default=200, help="KV put/wait rounds timed")
    parser.add_argument("--rounds", type=int, default=15, help="rounds of each ratio")
    parser.add_argument("--kv-rounds", type=int, default=5, help="rounds of the KV timeout ratio")
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    bench_fit()
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    run = f"bench-{uuid.uuid4().hex[:6]}"
    pool = ResourcePool(PoolSpec("bench", [4], {"CPU": 0.5}), run=run)
    try:
        group = WorkerGroup(BenchWorker, pool.bootstrap(timeout_s=60), role="bench", run=run)
        group.create(timeout_s=120)
        bench_noop(group, args.calls)
        bench_kv(run, args.kv)
        bench_kv_timeouts(run, args.kv_rounds)
        bench_broadcast(group, args.rounds)
        bench_dispatch(group, args.rounds)
        group.shutdown()
    finally:
        pool.teardown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
