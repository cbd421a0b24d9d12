"""Expert-parallel weight sync, before and after bucketing the experts, on gloo CPU ranks.

A tiny Qwen3-MoE (built from a config, random weights, ``--experts`` experts a block) is
trained by ``--ranks`` gloo processes with expert parallelism (``--ep``; default: every
rank), and its full weights are streamed as a rollout engine takes them
(`rayrl.train.weight_sync.rollout_weights`, ``--bucket-mb`` buckets), two ways, side by
side in the same processes, ``--repeats`` times each:

- ``before``: the stream as it was, each expert weight made whole alone
  (``full_tensor()``: two all-gathers, one per mesh dimension), the other weights in
  buckets split at every expert weight;
- ``after``: experts in the same buckets as the other weights, one all-gather per bucket
  for the experts (`rayrl.train.expert_sync`).

Per way it prints the sync's median seconds (rank 0), the collective calls per sync
(all-gathers, counted by the profiler on rank 0), and the peak bytes a rank held beyond
its shards while the stream ran (the CPU allocator's live bytes, profiled on rank 0,
each yielded tensor copied into a preallocated target and dropped, as
``update_weights`` does; also over the bucket size); then the after/before ratios, and
whether the two streams gave the same tensors bit for bit. On gloo a gathered bucket is
counted about twice: gloo's all-gather fills a flat buffer of its own and copies it out
(NCCL gathers in place), and the rank's packed shards (``1 / ranks`` of the bucket) live
until the gather ends.

Usage: ``python bench/moe_weight_sync.py [--ranks 2] [--experts 16] [--ep N]
[--bucket-mb 16] [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit_line, hardware

BENCH = "moe_weight_sync"


def build_model(out: Path, experts: int) -> Path:
    """A tiny Qwen3-MoE with ``experts`` experts a block (random weights, fp32)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rayrl.models.tiny import build_tiny_model

    path = build_tiny_model(out, family="qwen3_moe", layers=4, hidden=128, intermediate=512)
    config = AutoConfig.from_pretrained(path)
    config.num_experts = experts
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def before(model, dtype, bucket_bytes):
    """The stream as it was: experts are no bucket's, each made whole alone."""
    from rayrl.train.weight_sync import _dim0_shard, _gather_bucket, full_tensor, stream_buckets

    return stream_buckets(
        model,
        dtype,
        bucket_bytes,
        bucket=lambda params: _gather_bucket(params, dtype),
        single=lambda name, param: full_tensor(param, dtype),
        shardable=_dim0_shard,
    )


def after(model, dtype, bucket_bytes):
    from rayrl.train.weight_sync import rollout_weights

    return rollout_weights(model, dtype, bucket_bytes)


def consume(stream, targets) -> None:
    for name, tensor in stream:
        targets[name].copy_(tensor)


def profiled(stream_fn, model, dtype, bucket_bytes, targets) -> tuple[int, int]:
    """(all-gather calls, peak live bytes above the start) of one sync, by the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        consume(stream_fn(model, dtype, bucket_bytes), targets)
    calls = sum(1 for e in prof.events() if e.name == "gloo:all_gather")
    live = peak = 0
    memory = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    for e in sorted(memory, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return calls, peak


def worker(rank: int, world: int, args, model_dir: str, init: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from rayrl.train.engine import TrainEngine

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        engine = TrainEngine(model_dir, expert_parallel_size=args.ep or world, trainable=False)
        model, dtype, bucket = engine.model, torch.float32, int(args.bucket_mb * 2**20)
        shapes = {n: p.shape for n, p in model.named_parameters()}
        targets = {n: torch.empty(s, dtype=dtype) for n, s in shapes.items()}
        got = {}
        for way, fn in (("before", before), ("after", after)):
            got[way] = {n: t.clone() for n, t in fn(model, dtype, bucket)}
        same = set(got["before"]) == set(got["after"]) and all(
            torch.equal(got["before"][n], got["after"][n]) for n in got["before"]
        )
        del got
        result: dict = {"same": same, "experts_mb": _expert_mb(model)}
        for way, fn in (("before", before), ("after", after)):
            result[way] = {"calls": 0, "peak": 0, "seconds": []}
            result[way]["calls"], result[way]["peak"] = profiled(fn, model, dtype, bucket, targets)
        for _ in range(args.repeats):
            for way, fn in (("before", before), ("after", after)):
                dist.barrier()
                start = time.perf_counter()
                consume(fn(model, dtype, bucket), targets)
                result[way]["seconds"].append(time.perf_counter() - start)
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _expert_mb(model) -> float:
    from rayrl.train.expert_sync import expert_shard

    return sum(p.numel() * 4 for p in model.parameters() if expert_shard(p)) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--ep", type=int, default=0, help="expert-parallel size (0: --ranks)")
    parser.add_argument("--bucket-mb", type=float, default=16.0)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "m", args.experts)
        out = Path(tmp) / "result.json"
        init = Path(tmp) / "init"
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        mp.spawn(
            worker, args=(args.ranks, args, str(model_dir), str(init), str(out)), nprocs=args.ranks
        )
        result = json.loads(out.read_text())
    common = dict(
        ranks=args.ranks,
        ep=args.ep or args.ranks,
        experts=args.experts,
        bucket_mb=args.bucket_mb,
        expert_weights_mb=round(result["experts_mb"], 2),
        hardware=hardware(),
    )
    emit = lambda metric, value, unit, **kw: emit_line(BENCH, metric, value, unit, **common, **kw)  # noqa: E731
    median = {w: statistics.median(result[w]["seconds"]) for w in ("before", "after")}
    for way in ("before", "after"):
        emit(f"sync_s_{way}", median[way], "s", repeats=args.repeats)
        emit(f"all_gathers_{way}", result[way]["calls"], "calls")
        emit(f"peak_extra_mb_{way}", result[way]["peak"] / 2**20, "MiB")
        emit(f"peak_extra_over_bucket_{way}", result[way]["peak"] / 2**20 / args.bucket_mb, "x")
    emit(
        "sync_time_ratio_after_over_before", median["after"] / median["before"], "x", better="lower"
    )
    emit(
        "all_gathers_ratio_after_over_before",
        result["after"]["calls"] / max(result["before"]["calls"], 1),
        "x",
        better="lower",
    )
    emit("same_tensors_bitwise", result["same"], "bool")


if __name__ == "__main__":
    main()
