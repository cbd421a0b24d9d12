"""The decode step captured in CUDA graphs, one graph per batch-size bucket.

A decode step launches a few hundred small kernels; replaying a CUDA graph launches
them all at once. Graphs have fixed shapes and addresses, so the step's inputs live in
one static ``[8, max_batch]`` int64 buffer (token, position, cache slot, block-table
row, context length, sample key, sample position, and the row of the previous step's
draw that holds the token when it comes from the device), and a batch of n sequences
runs the graph of the smallest bucket >= n with the rows past n padded (context length
0 and cache slot -1: no attention work, no cache write). Graphs are captured on the
step's own staged inputs (all graphs share one memory pool): the capture's warm-up
forwards write the same cache entries the replay then writes again. The graphs hold
the KV cache's address:

* where the cache keeps it across `sleep` (CUDA's virtual memory, `vmm`), the graphs
  stay for the engine's life, so the first batch that needs a graph captures every
  bucket at once: a one-time cost, after which no rollout captures again (a multi-turn
  rollout's batch size wanders through many buckets; captured one by one, each new
  one stalled a rollout, docs/benchmarks.md 2026-12-03);
* elsewhere `sleep` drops them, so a bucket is captured the first time a batch needs it
  after a wake: capturing only the buckets a rollout uses (one or a few when the
  responses end together) keeps the per-step cost of a hybrid engine small, where
  capturing every bucket at each wake cost a large share of a step.
"""

from __future__ import annotations

import bisect
import functools
import time

import numpy as np
import torch
from torch import Tensor

from rayrl.rollout.native.step import StepInput

__all__ = ["CapturedForwards", "DecodeGraphs", "graph_buckets"]

_PAD = (0, 0, -1, 0, 0, 0, 0, 0)  # per field: a padded row does no work


@functools.cache
def _side_stream(device: int) -> torch.cuda.Stream:
    """The one stream captures warm up on, per device: every stream a cuBLAS call runs on
    keeps a workspace of its own (tens of MiB) for the life of the process, so a fresh
    stream per capture would leave one behind at every wake."""
    return torch.cuda.Stream(device=device)


def graph_buckets(max_batch: int) -> list[int]:
    """Batch sizes with a graph: 1, 2, 4, 8, then steps of 8 to 64, of 32 to 256, of 64 on."""
    sizes = {1, 2, 4, 8, *range(16, 65, 8), *range(96, 257, 32), *range(320, max_batch + 1, 64)}
    return sorted(s for s in sizes if s < max_batch) + [max_batch]


class CapturedForwards:
    """A `ModelRunner`'s model forward captured in CUDA graphs, one per bucket (a key the
    subclass maps to its step's static inputs, `_step`), all in one memory pool; the
    graphs' logits, and how many captures there were and how long they took."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, Tensor] = {}
        self.pool = None  # the graphs' shared memory pool, from the first capture on
        self.captures = 0
        self.capture_s = 0.0  # host time spent capturing (warm-ups included)

    def _step(self, bucket: int) -> StepInput:
        raise NotImplementedError

    def _capture(self, bucket: int) -> None:
        """Capture the bucket's forward, on its static inputs as they are now: two
        warm-up forwards first, outside the capture (Triton compiles and autotunes), on
        the one side stream; they write the cache entries the step then writes again."""
        since = time.perf_counter()
        model, cache = self.runner.model, self.runner.cache
        step = self._step(bucket)
        side = _side_stream(torch.cuda.current_device())
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                model.forward(step, cache)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.logits[bucket] = model.forward(step, cache)
        self.graphs[bucket] = graph
        self.pool = graph.pool()
        self.captures += 1
        self.capture_s += time.perf_counter() - since


class DecodeGraphs(CapturedForwards):
    """Captured decode forwards of a `ModelRunner`'s model, by batch size."""

    def __init__(self, runner, max_batch: int) -> None:
        super().__init__(runner)
        self.buckets = graph_buckets(max_batch)
        size = self.buckets[-1]
        dev = runner.device
        self.static = torch.tensor(_PAD, dtype=torch.int64, device=dev)[:, None].repeat(1, size)
        self.rows = torch.arange(size, device=dev)

    def _step(self, batch: int) -> StepInput:
        s = self.static[:, :batch]
        return StepInput(
            input_ids=s[0],
            positions=s[1],
            slot_mapping=s[2],
            seq_rows=s[3],
            seq_lens=s[4],
            block_table=self.runner.table,
            logits_rows=self.rows[:batch],
            decode=True,
        )

    def fits(self, batch: int) -> bool:
        return batch <= self.buckets[-1]

    def bucket(self, batch: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, batch)]

    def stage(self, arrays: list[np.ndarray]) -> list[Tensor]:
        """Write a batch's host arrays (the 8 fields) into the static inputs; return them.

        The staging buffer is pinned memory from torch's caching host allocator, which
        reuses it only once this copy is done: the host may stage the next step while the
        device has yet to run this one.
        """
        n = len(arrays[0])
        size = self.bucket(n)
        staging = torch.empty(self.static.shape, dtype=torch.int64, pin_memory=True)
        host = staging.numpy()
        for i, values in enumerate(arrays):
            host[i, :n] = values
            host[i, n:size] = _PAD[i]
        self.static.copy_(staging, non_blocking=True)  # 8 x max_batch int64: tiny
        return list(self.static.unbind(0))

    def run(self, batch: int) -> Tensor:
        """Replay the bucket's graph; its logits ``[bucket, vocab]`` (valid until the next replay)."""
        size = self.bucket(batch)
        if size not in self.graphs:
            self._capture_for(batch)
        self.graphs[size].replay()
        return self.logits[size]

    def _capture_for(self, batch: int) -> None:
        """Capture the graph a batch of ``batch`` rows needs; every bucket where the
        graphs outlive a sleep (see the module docstring)."""
        if not self.runner.cache.fixed_address:
            self._capture(self.bucket(batch))
            return
        # rows past the batch hold earlier steps' inputs (or nothing): padded, so that
        # the larger buckets' warm-ups write no cache slot another sequence may own now
        self.static[:, batch:] = self.static.new_tensor(_PAD)[:, None]
        for size in self.buckets:
            if size not in self.graphs:
                self._capture(size)
