"""Where the actor update's time goes: one PPO train step of the reference-shape model
on the engine directly, under torch.profiler (issue 13's MFU target).

The work is `bench/gpu_e2e.py`'s update: ``--seqs`` rows of ``--prompt-len`` +
``--response-len`` tokens (random ids, every token real), the PPO clip loss with
``use_kl_loss=false``, packed micro-batches of ``--max-tokens`` tokens, one AdamW step.
A warm-up step runs first. JSON lines: ``update_s`` and ``mfu`` of the profiled step
(FLOPs as `perf/mfu/actor` counts them), ``update_s_plain`` / ``mfu_plain`` of a step
without the profiler, and ``kernel`` lines: the top ``--top`` CUDA kernels (or CPU ops
on a CPU) by self time, with their share of the step's device time. On CUDA a
``gpu_busy_fraction`` line first: the time some kernel ran over the profiled step, each
stream's total, and the kernels that ran beside another stream, whose durations in the
table are stretched by it (`_kernel_timeline`); then ``gpu_idle_s``: the time no
stream ran anything, binned by gap length, and the longest gaps with their neighbours.

``--variants`` runs several engine set-ups one after the other on the same batch and
old log-probs (each from the same initial weights, so the warm-up steps' ``loss`` and
``grad_norm``, in the ``first_step`` lines, compare the set-ups' arithmetic):
``fsdp`` (`fsdp_config.wrap_one_gpu`: FSDP2 bf16 compute, fp32 master weights),
``autocast`` (the default: the unwrapped fp32 model under torch.autocast), each with an
optional ``@TOKENS`` micro-batch token budget, ``#CHUNK`` log-prob chunk size and
``+compile`` (`rayrl.train.regional_compile`; the warm-up step absorbs the compile)
or ``+compile-attn-out`` (the same with the attention call left out of the graphs),
e.g. ``--variants autocast,fsdp,fsdp@32768#4096,fsdp@32768+compile``.

    python bench/profile_update.py [--seqs 512] [--preset qwen2.5-0.5b] [--device cuda]
        [--variants fsdp] [--prompt-len 256 --response-len 256] [--checkpointing]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path

import torch

from _common import hardware
from _kernel_timeline import device_intervals, idle_gaps, summary
from gpu_e2e import build_model

BENCH = "profile_update"
COMPILE_MODES = ("compile", "compile-attn-out")


def make_batch(seqs: int, prompt: int, response: int, vocab: int, group: int = 1):
    """Random rows; each ``group`` consecutive rows share their prompt (GRPO's samples)."""
    from rayrl.batch import Batch

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (seqs, prompt + response), generator=gen)
    ids[:, :prompt] = ids[::group, :prompt].repeat_interleave(group, dim=0)[:seqs]
    mask = torch.ones_like(ids)
    return Batch.from_dict(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": mask.cumsum(-1) - 1,
            "responses": ids[:, prompt:],
            "response_mask": mask[:, prompt:],
            "advantages": torch.randn(seqs, response, generator=gen),
        },
        meta={"temperature": 1.0},
    )


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
    p.add_argument("--variants", default="fsdp", help="comma-separated, see the docstring")
    p.add_argument("--no-profile", action="store_true", help="time steps only, no profiler")
    p.add_argument("--group", type=int, default=8, help="rows per prompt (GRPO's n)")
    p.add_argument(
        "--share-prompts",
        default="auto",
        help="the engine's share_prompts: true, false or auto (the config's default)",
    )
    p.add_argument(
        "--sync-points",
        action="store_true",
        help="CUDA: one more step under torch's sync debug mode: where the host waited",
    )
    p.add_argument(
        "--checkpointing",
        action="store_true",
        help="activation checkpointing (long sequences: e.g. --seqs 8 --prompt-len 1024 "
        "--response-len 15360 --max-tokens 16384)",
    )
    args = p.parse_args()
    args.sft_steps = 0
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(args, Path(tmp))
        old = None
        for variant in args.variants.split(","):
            old = run_variant(args, path, variant, old)


def parse_variant(text: str, args: argparse.Namespace) -> dict:
    """``NAME[@TOKENS][#CHUNK][+compile|+compile-attn-out]`` as engine options."""
    body, plus, extra = text.partition("+")
    name, _, chunk = body.partition("#")
    name, _, tokens = name.partition("@")
    if name not in ("fsdp", "autocast") or (plus and extra not in COMPILE_MODES):
        raise SystemExit(
            f"unknown variant {text!r}: use fsdp or autocast[@TOKENS][#CHUNK]"
            "[+compile|+compile-attn-out]"
        )
    return {
        "fsdp": name == "fsdp",
        "max_tokens": int(tokens or args.max_tokens),
        "chunk": int(chunk or 1024),
        "compile": extra if plus else None,
    }


def run_variant(args: argparse.Namespace, path: Path, variant: str, old):
    """Profile one set-up; returns the old log-probs (computed by the first one)."""
    import gc

    from torch.profiler import ProfilerActivity, profile

    from rayrl.batch import Batch
    from rayrl.config import load_config
    from rayrl.train.engine import TrainEngine
    from rayrl.train.regional_compile import compile_regions
    from rayrl.workers.common import update_perf_metrics
    from rayrl.workers.losses import actor_loss_fn

    opts = parse_variant(variant, args)
    engine = TrainEngine(
        path,
        optim={"lr": 1e-6},
        total_steps=10,
        device=args.device,
        fsdp=opts["fsdp"] and args.device == "cuda",
        logit_chunk_size=opts["chunk"],
        torch_compile=opts["compile"] == "compile",
        gradient_checkpointing=args.checkpointing,
        share_prompts={"true": True, "false": False}.get(args.share_prompts, args.share_prompts),
    )
    if opts["compile"] == "compile-attn-out":  # the attention call outside the graphs
        engine.compiled = compile_regions(engine.model, engine.device, attention_in_graph=False)
    budget = opts["max_tokens"]
    batch = make_batch(
        args.seqs, args.prompt_len, args.response_len, engine.config.vocab_size, args.group
    )
    if old is None:
        old = engine.forward(batch, max_tokens_per_micro_batch=budget)["log_probs"]
    batch = batch.union(Batch({"old_log_probs": old}))
    actor = load_config(
        "grpo", ["actor_rollout_ref.actor.use_kl_loss=false"]
    ).actor_rollout_ref.actor
    loss = actor_loss_fn(actor, args.response_len)
    base = {
        "bench": BENCH,
        "preset": args.preset,
        "seqs": args.seqs,
        "variant": variant,
        "fsdp": engine.fsdp,
        "compiled": engine.compiled,
        "max_tokens": budget,
        "chunk": opts["chunk"],
        "tokens": args.seqs * (args.prompt_len + args.response_len),
        "sequence_len": args.prompt_len + args.response_len,
        "checkpointing": args.checkpointing,
        "group": args.group,
        "share_prompts": engine.share_prompts,
        "hardware": hardware(args.device),
    }
    try:
        first = engine.train_step(batch, loss, max_tokens_per_micro_batch=budget)  # warm-up
    except torch.OutOfMemoryError as err:
        emit({**base, "metric": "error", "value": None, "unit": "", "error": str(err)[:200]})
        del engine
        gc.collect()
        torch.cuda.empty_cache()
        return old
    emit(
        {
            **base,
            "metric": "first_step",
            "value": None,
            "unit": "",
            "loss": first["loss"],
            "grad_norm": first["grad_norm"],
        }
    )
    _sync(args.device)
    if args.sync_points and args.device == "cuda":
        for site, count in sync_points(
            lambda e=engine: e.train_step(batch, loss, max_tokens_per_micro_batch=budget)
        ):
            emit({**base, "metric": "sync_point", "value": count, "unit": "calls", "site": site})
    start = time.perf_counter()
    engine.train_step(batch, loss, max_tokens_per_micro_batch=budget)
    _sync(args.device)
    plain = time.perf_counter() - start
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=activities) if not args.no_profile else nullcontext() as prof:
        start = time.perf_counter()
        metrics = engine.train_step(batch, loss, max_tokens_per_micro_batch=budget)
        _sync(args.device)
        seconds = time.perf_counter() - start
    flops = engine.train_flops(batch)
    if args.device == "cuda":
        base["peak_mem_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
        torch.cuda.reset_peak_memory_stats()
    del engine
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    for name, secs in (("update_s_plain", plain), ("update_s", seconds)):
        emit({**base, "metric": name, "value": secs, "unit": "s"})
        perf = update_perf_metrics(flops, secs, torch.device(args.device))
        if "mfu" in perf:
            emit(
                {
                    **base,
                    "metric": name.replace("update_s", "mfu"),
                    "value": perf["mfu"],
                    "unit": "fraction",
                    "target": 0.4,
                    "better": "higher",
                }
            )
    emit(
        {
            **base,
            "metric": "train_step_metrics",
            "value": None,
            "unit": "",
            "metrics": {k: v for k, v in metrics.items() if isinstance(v, float)},
        }
    )
    if args.no_profile:
        return old
    if args.device == "cuda":
        intervals = device_intervals(prof)
        timeline = summary(intervals)
        emit(
            {
                **base,
                "metric": "gpu_busy_fraction",
                "value": timeline["busy_s"] / seconds,
                "unit": "fraction",
                **timeline,
            }
        )
        gaps = idle_gaps(intervals, top=args.top)
        emit({**base, "metric": "gpu_idle_s", "value": gaps.pop("idle_s"), "unit": "s", **gaps})
    key = "self_device_time_total" if args.device == "cuda" else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, key, 0) > 0]
    total = sum(getattr(e, key) for e in events) or 1.0
    for e in sorted(events, key=lambda e: -getattr(e, key))[: args.top]:
        emit(
            {
                **base,
                "metric": "kernel",
                "value": getattr(e, key) / 1e3,
                "unit": "ms",
                "name": e.key[:120],
                "calls": e.count,
                "share": getattr(e, key) / total,
            }
        )
    return old


def sync_points(run) -> list[tuple[str, int]]:
    """Run ``run()`` under torch's CUDA sync debug mode; each place in rayrl's code
    where the host waited for the device (the innermost rayrl frames of the warning's
    stack, and the call that waited), with how many times, most first."""
    import traceback
    import warnings

    counts: dict[str, int] = defaultdict(int)

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "/rayrl/" in f.filename]
        where = " < ".join(
            f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-3:][::-1]
        )
        counts[f"{where or filename + ':' + str(lineno)} | {str(message)[:60]}"] += 1

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sorted(counts.items(), key=lambda kv: -kv[1])


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def emit(line: dict) -> None:
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
