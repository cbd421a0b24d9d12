"""Host cost of one prefill step of resumed multi-turn samples in the native engine, on CPU.

A multi-turn rollout (workload M, `bench/rollout_agent.py`) prefills samples whose tool
answers came back: each appends a few tokens onto a KV cache it already holds. This
builds such a step directly (``--seqs`` samples, each with ``--context`` cached
tokens and ``--new`` tokens to append) on a tiny model, runs the engine's prefill
step (`NativeRolloutEngine._prefill`: plan, step inputs, forward, first-token draw,
commit) ``--repeats`` times, and reports per step, in CPU time of the thread (the
machine's other load barely changes it; the best of the repeats):

- ``step_ms``: the whole step;
- ``forward_ms``: the model's forward (``attention_ms`` of it: the prefill attention);
- ``draw_ms``: the first-token draw;
- ``host_ms``: the rest: planning, step inputs, copies, bookkeeping.

The cache holds zeros (the forward's numbers do not matter here, only its cost).

    PYTHONPATH=src:bench python bench/prefill_host.py [--seqs 32] [--context 512]
        [--new 24] [--repeats 20] [--layers 2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from collections import defaultdict

import numpy as np
import torch

from _common import hardware
from rayrl.models.tiny import TinySpec
from rayrl.rollout import NativeRolloutEngine, SamplingParams
from rayrl.rollout.native.kv_cache import BlockAllocator
from rayrl.rollout.native.scheduler import Scheduler
from rayrl.rollout.native.step_loop import Stepper


class CpuClock:
    """CPU time of the calling thread spent in wrapped callables, by name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.thread_time() - start

        return timed


def build(args) -> NativeRolloutEngine:
    from transformers import Qwen2ForCausalLM

    spec = TinySpec(
        layers=args.layers, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab_size=512
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(spec.to_config()).float().eval()
    length = args.context + args.new + 8
    engine = NativeRolloutEngine(
        model=model,
        device="cpu",
        max_num_seqs=args.seqs,
        max_model_len=length,
        max_num_batched_tokens=max(8192, args.seqs * args.new),
        cpu_cache_tokens=2 * args.seqs * length,
    )
    engine.cache.data.zero_()
    return engine


def resumed_step(engine: NativeRolloutEngine, args) -> Scheduler:
    """A scheduler whose waiting jobs are resumed samples: ``context`` tokens cached."""
    rng = np.random.default_rng(0)
    total = args.context + args.new
    sched = Scheduler(
        allocator=BlockAllocator(engine.cache.num_blocks),
        block_size=engine.block_size,
        max_batched_tokens=engine.max_num_batched_tokens,
        table=engine.runner.table_host,
        stop_ids=np.asarray([], dtype=np.int64),
        capacity=args.seqs,
    )
    for key in range(args.seqs):
        sched.add(rng.integers(0, 512, total), np.array([8]), np.array([key]))
    for job in sched.waiting:
        job.done = args.context
    return sched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--context", type=int, default=512, help="cached tokens per sample")
    parser.add_argument("--new", type=int, default=24, help="appended tokens per sample")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = build(args)
    clock = CpuClock()
    model, sampler = engine.runner.model, engine.runner.sampler
    model.forward = clock.wrap("forward", model.forward)
    model.attention = clock.wrap("attention", model.attention)
    sampler.draw = clock.wrap("draw", sampler.draw)
    sampling = SamplingParams(max_new_tokens=8, seed=1)
    runs = []
    for _ in range(args.repeats + 1):  # the first one warms up
        sched = resumed_step(engine, args)
        clock.seconds.clear()
        start = time.thread_time()
        loop = Stepper(engine.runner, sched, False, defaultdict(float))
        loop.sampling = sampling
        loop._prefill(sched.plan_prefill())
        step = time.thread_time() - start
        assert not sched.waiting and len(sched.running) == args.seqs
        parts = dict(clock.seconds)
        runs.append({"step": step, **parts})
    best = min(runs[1:], key=lambda r: r["step"])
    ms = {k: round(1000 * v, 3) for k, v in best.items()}
    record = {
        "bench": "prefill_host",
        "hardware": hardware("cpu"),
        "date": datetime.date.today().isoformat(),
        "seqs": args.seqs,
        "context": args.context,
        "new": args.new,
        "layers": args.layers,
        "step_ms": ms["step"],
        "forward_ms": ms.get("forward", 0.0),
        "attention_ms": ms.get("attention", 0.0),
        "draw_ms": ms.get("draw", 0.0),
        "host_ms": round(ms["step"] - ms.get("forward", 0.0) - ms.get("draw", 0.0), 3),
    }
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
