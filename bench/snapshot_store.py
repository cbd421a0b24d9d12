"""Benchmark: how fast a step snapshot goes into Ray's object store, round after round.

A worker's step snapshot is a dict of NumPy arrays (`rayrl.train.snapshot`) that the
worker returns from a two-return call (`Worker._rayrl_snapshot_publish`); Ray copies it
into its node's object store while the next step runs, and the next boundary waits for
that copy (`timing_s/snapshot`). This script does the same with an actor holding
``--gib`` GiB in ``--pieces`` float32 arrays (the reference 0.5B actor's 290 fp32
parameters and their two Adam moments are about 5.5 GiB), for ``--rounds`` rounds, keeping the
last two rounds' objects alive as the step replay keeps two boundaries.

The object store maps its shared memory lazily: a round that lands on pages no object
used before pays the kernel's first touch of each page; a round that reuses freed
objects' pages is a plain copy. JSON lines: ``handover_s`` per round (with GiB/s),
then ``handover_first_s`` and ``handover_last_s`` (the first and the last round).

    python bench/snapshot_store.py [--gib 5.5] [--pieces 290] [--rounds 6]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import ray

from _common import emit_line, hardware

BENCH = "snapshot_store"


@ray.remote(num_cpus=1)
class Holder:
    """Holds a snapshot-shaped state and hands it over as the worker's publish does."""

    def __init__(self, gib: float, pieces: int) -> None:
        n = int(gib * 2**30 / 4 / pieces)
        rng = np.random.default_rng(0)
        self.state = {f"t{i}": rng.random(n, dtype=np.float32) for i in range(pieces)}

    def ready(self) -> int:
        return len(self.state)

    def publish(self) -> tuple[int, dict]:
        return 0, self.state


def handover_rounds(gib: float, pieces: int, rounds: int) -> list[float]:
    """Seconds of each round's hand-over (the call until its first return is ready)."""
    holder = Holder.remote(gib, pieces)
    ray.get(holder.ready.remote())
    kept: list = []
    seconds = []
    for _ in range(rounds):
        start = time.perf_counter()
        done, state = holder.publish.options(num_returns=2).remote()
        ray.get(done)
        seconds.append(time.perf_counter() - start)
        kept = [*kept[-1:], state]  # the last two rounds stay alive
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=5.5)
    p.add_argument("--pieces", type=int, default=290)
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args()
    ray.init(include_dashboard=False, log_to_driver=False)
    store = ray.available_resources().get("object_store_memory", 0.0) / 2**30
    common = {"gib": args.gib, "store_gib": round(store, 1), "hardware": hardware()}
    seconds = handover_rounds(args.gib, args.pieces, args.rounds)
    for i, s in enumerate(seconds):
        emit_line(BENCH, "handover_s", s, "s", round=i, gib_per_s=round(args.gib / s, 2), **common)
    emit_line(BENCH, "handover_first_s", seconds[0], "s", **common)
    emit_line(BENCH, "handover_last_s", seconds[-1], "s", **common)
    ray.shutdown()


if __name__ == "__main__":
    main()
