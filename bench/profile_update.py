"""Where the actor update's time goes: one PPO train step of the reference-shape model
on the engine directly, under torch.profiler (issue 13's MFU target).

The work is `bench/gpu_e2e.py`'s update: ``--seqs`` rows of ``--prompt-len`` +
``--response-len`` tokens (random ids, every token real), the PPO clip loss with
``use_kl_loss=false``, packed micro-batches of ``--max-tokens`` tokens, one AdamW step.
A warm-up step runs first. JSON lines: ``update_s`` and ``mfu`` of the profiled step
(FLOPs as `perf/mfu/actor` counts them), and ``kernel`` lines: the top ``--top``
CUDA kernels (or CPU ops on a CPU) by self time, with their share of the step's
device time.

    python bench/profile_update.py [--seqs 512] [--preset qwen2.5-0.5b] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from _common import hardware
from gpu_e2e import build_model

BENCH = "profile_update"


def make_batch(seqs: int, prompt: int, response: int, vocab: int):
    from rayrl.batch import Batch

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (seqs, prompt + response), generator=gen)
    mask = torch.ones_like(ids)
    return Batch.from_dict({
        "input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1,
        "responses": ids[:, prompt:], "response_mask": mask[:, prompt:],
        "advantages": torch.randn(seqs, response, generator=gen),
    }, meta={"temperature": 1.0})  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--response-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=16384)
    p.add_argument("--preset", default="qwen2.5-0.5b", choices=["qwen2.5-0.5b", "tiny"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--model-dir", default=None)
    args = p.parse_args()
    args.sft_steps = 0
    from torch.profiler import ProfilerActivity, profile

    from rayrl.batch import Batch
    from rayrl.config.schema import ActorConfig
    from rayrl.engines.train import TrainEngine
    from rayrl.workers.common import update_perf_metrics
    from rayrl.workers.losses import actor_loss_fn

    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(args, Path(tmp))
        engine = TrainEngine(path, optim={"lr": 1e-6}, total_steps=10, device=args.device)
        batch = make_batch(args.seqs, args.prompt_len, args.response_len, engine.config.vocab_size)
        old = engine.forward(batch, max_tokens_per_micro_batch=args.max_tokens)["log_probs"]
        batch = batch.union(Batch({"old_log_probs": old}))
        loss = actor_loss_fn(ActorConfig(use_kl_loss=False), args.response_len)
        engine.train_step(batch, loss, max_tokens_per_micro_batch=args.max_tokens)  # warm-up
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            metrics = engine.train_step(batch, loss, max_tokens_per_micro_batch=args.max_tokens)
            if args.device == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
        flops = engine.train_flops(batch)
    base = {"bench": BENCH, "preset": args.preset, "seqs": args.seqs,
            "tokens": args.seqs * (args.prompt_len + args.response_len),
            "hardware": hardware(args.device)}  # fmt: skip
    emit({**base, "metric": "update_s", "value": seconds, "unit": "s"})
    perf = update_perf_metrics(flops, seconds, torch.device(args.device))
    if "mfu" in perf:
        emit({**base, "metric": "mfu", "value": perf["mfu"], "unit": "fraction",
              "target": 0.4, "better": "higher"})  # fmt: skip
    emit({**base, "metric": "train_step_metrics", "value": None, "unit": "",
          "metrics": {k: v for k, v in metrics.items() if isinstance(v, float)}})  # fmt: skip
    key = "self_device_time_total" if args.device == "cuda" else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, key, 0) > 0]
    total = sum(getattr(e, key) for e in events) or 1.0
    for e in sorted(events, key=lambda e: -getattr(e, key))[: args.top]:
        emit({**base, "metric": "kernel", "value": getattr(e, key) / 1e3, "unit": "ms",
              "name": e.key[:120], "calls": e.count, "share": getattr(e, key) / total})  # fmt: skip


def emit(line: dict) -> None:
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
