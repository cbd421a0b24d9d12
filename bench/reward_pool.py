"""Benchmark: the rule-based reward pool scoring a step's samples.

Times `RewardPool.score` on ``--items`` arithmetic samples (the built-in scorers) with
``--workers`` processes, samples queued ahead in each worker (`AHEAD_SAMPLES`, the
default) against one at a time (the pool before the queue), interleaved rounds.
Prints JSON lines (``score_ms`` per setting: median and all rounds).

    python bench/reward_pool.py [--items 512] [--workers 1,2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from _common import hardware
from rayrl.data import synthetic_rows
from rayrl.rewards import pool as pool_module
from rayrl.rewards.items import make_items
from rayrl.rewards.pool import RewardPool


def items(n: int) -> list[dict]:
    rows = synthetic_rows("arithmetic", n, seed=0)
    return make_items(
        [r["data_source"] for r in rows],
        [f"The answer is {i}" for i in range(n)],
        [{"ground_truth": r["reward_model"]["ground_truth"]} for r in rows],
        None,
        None,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--items", type=int, default=512)
    p.add_argument("--workers", default="1,2")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    samples = items(args.items)
    ahead = {"queued": pool_module.AHEAD_SAMPLES, "one_at_a_time": 0}
    for workers in (int(w) for w in args.workers.split(",")):
        with RewardPool(None, num_workers=workers) as pool:
            pool.score(samples[:8])  # workers ready
            times: dict[str, list[float]] = {name: [] for name in ahead}
            for _ in range(args.rounds):
                for name, depth in ahead.items():
                    pool_module.AHEAD_SAMPLES = depth
                    start = time.perf_counter()
                    pool.score(samples)
                    times[name].append((time.perf_counter() - start) * 1e3)
            pool_module.AHEAD_SAMPLES = ahead["queued"]
        for name, values in times.items():
            line = {
                "bench": "reward_pool",
                "metric": "score_ms",
                "setting": name,
                "workers": workers,
                "items": args.items,
                "value": round(statistics.median(values), 2),
                "all": [round(v, 2) for v in values],
                "unit": "ms",
                "hardware": hardware("cpu"),
            }
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
