"""Benchmark: rollout throughput of the native engine against rayrl's HF engine and transformers.

Workloads (issue 12), on the reference shape (docs/benchmarks.md: Qwen2.5-0.5B config,
random weights, bf16 on CUDA), prompts of random token ids, sampling at temperature 1:

- A: 256 prompts of 256 tokens, 256 new tokens each (EOS ignored).
- B: 256 sequences, prompt and output lengths uniform in [100, 1024] (numpy seed 0).
- C: long contexts (reasoning length): 64 prompts of 1,024 tokens, output lengths
  uniform in [4096, 8192] (numpy seed 0).
- G: the generation of `bench/gpu_e2e.py`'s GRPO step: 64 prompts of 256 tokens, 8
  samples each (sharing their prompt's prefill), 256 new tokens each, 1,024 sequences
  at most in flight (the trainer's default): the bare engine against the step's `gen`
  stage. Its roofline counts every sample's prompt, as `step_vs_roofline`'s does.
- M: multi-turn agent episodes, up to 4 tool calls of 50 ms each, on the native
  engine, against single-turn decoding of the same tokens (`bench/rollout_agent.py`:
  its records and their targets).

Engines, in one run on one model object: ``native`` (NativeRolloutEngine, per-sequence
output lengths), ``rayrl_hf`` (HFRolloutEngine), ``hf_dynamic`` and ``hf_static``
(transformers ``generate()`` with the dynamic / static cache, auto-compile off).
A static batch cannot end rows early, so the HF engines run every row of B to the
longest output; all engines are credited with the tokens the workload asks for only.

Prints JSON lines: ``tokens_per_s`` (per engine and workload), ``peak_mem_gb``,
``speedup_vs_hf_static`` and ``roofline_fraction`` of the native engine, where the
roofline is the time a step needs at the machine's measured HBM bandwidth or bf16
matmul rate, whichever binds, summed over the prefill and every decode step.

    python bench/rollout.py [--device cuda|cpu] [--shape reference|tiny|moe|7b|mistral|gemma2|gemma3]
        [--engines native,rayrl_hf,hf_dynamic,hf_static] [--workloads A,B,C,G,M]
        [--skip hf_dynamic@B,...] [--repeats 3] [--profile] [--tune-decode] [--tune-sampler]
        [--sync-decode] [--tp N] [--resume-prefill-cost C] [--prefill-graph-tokens T]
        [--switch-interval S] [--host-profile]
        [--out bench/results/rollout-DATE.jsonl]

``--profile`` adds the native engine's top CUDA kernels and GPU busy fraction;
``--tune-decode`` / ``--tune-sampler`` first sweep the decode-attention / sampler kernel's
launch settings. Engine ``native_sync`` is the native engine without overlapped decode
(``--sync-decode`` turns it off for ``native`` too); ``native_fp8`` keeps its dense
layers' matrices in FP8 (``rollout.quantization=fp8``), and ``fp8_over_bf16`` compares
it with ``native`` where both ran.

``--tp N`` splits the native engine's model over N GPUs (tensor parallelism: one
process a GPU, NCCL; gloo on CPU), one replica running the whole workload; rank 0
reports, and the roofline counts the N GPUs' bandwidth and matmul rate. ``--tp 1`` (the
default) is the one-GPU engine, whose code issues no collective.

``--device cpu --shape tiny`` is a smoke run (small workloads, a tiny model).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _common import cold_prefix, hardware, seqs_limit
from rayrl.batch import Batch
from rayrl.models.tiny import reference_05b
from rayrl.rollout import HFRolloutEngine, NativeRolloutEngine, SamplingParams
from rayrl.rollout.native.tp import make_tp_groups
from rollout_agent import run_multi_turn
from rollout_models import FAMILIES, build_model
from roofline import H200, generation_seconds, resolve_card

TARGETS = {("tokens_per_s", "A"): 100_000.0, "speedup_vs_hf_static": 5.0}
QUIET = {"on": False}  # TP ranks past 0 run the workload but report nothing


def workload(name: str, shape: str, vocab: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Prompts (token ids) and output lengths of workload A, B, C or G: one length per
    sample, the samples of a prompt next to each other (`samples_per_prompt`)."""
    rng = np.random.default_rng(0)
    tiny = shape == "tiny"
    n = 8 if tiny else 256
    if name == "A":
        p_len, o_len = (16, 16) if tiny else (256, 256)
        prompt_lens, out_lens = np.full(n, p_len), np.full(n, o_len)
    elif name == "G":  # the GRPO step's generation: 64 prompts x 8 samples
        n, samples, p_len, o_len = (4, 2, 16, 16) if tiny else (64, 8, 256, 256)
        prompt_lens, out_lens = np.full(n, p_len), np.full(n * samples, o_len)
    elif name == "C":  # reasoning length: 64 prompts of 1k tokens, 4k-8k tokens out
        n, p_len, (lo, hi) = (4, 16, (16, 48)) if tiny else (64, 1024, (4096, 8192))
        prompt_lens, out_lens = np.full(n, p_len), rng.integers(lo, hi + 1, n)
    else:
        lo, hi = (4, 24) if tiny else (100, 1024)
        prompt_lens, out_lens = rng.integers(lo, hi + 1, n), rng.integers(lo, hi + 1, n)
    prompts = [rng.integers(10, vocab, int(p)) for p in prompt_lens]
    return prompts, out_lens.astype(np.int64)


def samples_per_prompt(prompts: list, out_lens: np.ndarray) -> int:
    return len(out_lens) // len(prompts)


def sample_rows(prompts: list, out_lens: np.ndarray) -> list:
    """Each sample's prompt: the prompts repeated for engines that do not share them."""
    n = samples_per_prompt(prompts, out_lens)
    return [p for p in prompts for _ in range(n)]


def padded(prompts: list[np.ndarray], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.from_numpy(p)
        mask[i, width - len(p) :] = 1
    return ids.to(device), mask.to(device)


# ---------------------------------------------------------------- engines
def max_model_len(prompts: list[np.ndarray], out_lens: np.ndarray, shape: str) -> int:
    """4096 tokens for the reference shape (64 for the tiny one), or the workload's
    longest sequence rounded up to 64 where that is longer (workload C)."""
    longest = max(len(p) for p in prompts) + int(out_lens.max())
    return max(4096 if shape in ("reference", "7b", *FAMILIES) else 64, -(-longest // 64) * 64)


def run_native(
    model, prompts, out_lens, args, overlap: bool = True, quantization: str | None = None
) -> Callable[[], None]:
    engine = NativeRolloutEngine(
        model=model,
        device=args.device,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=seqs_limit(args, args.workload_name),
        max_model_len=max_model_len(prompts, out_lens, args.shape),
        overlap_decode=overlap and not args.sync_decode,
        tp_size=args.tp,
        tp_group=getattr(args, "tp_group", None),
        **({"quantization": quantization} if quantization else {}),
    )
    n = samples_per_prompt(prompts, out_lens)
    params = SamplingParams(n=n, max_new_tokens=int(out_lens.max()), ignore_eos=True, seed=1)
    # Warm-up on the workload itself: Triton autotuning and the CUDA graphs of the batch
    # sizes it passes through (captured on first use) stay out of the timed run.
    engine.generate_token_ids(prompts, params, max_new_tokens=out_lens)
    run_native.engine = engine

    def run():
        cold_prefix(engine, args)
        engine.generate_token_ids(prompts, params, max_new_tokens=out_lens)

    return run


def run_native_sync(model, prompts, out_lens, args) -> Callable[[], None]:
    """The native engine with every decode step committed before the next is launched."""
    return run_native(model, prompts, out_lens, args, overlap=False)


def run_native_fp8(model, prompts, out_lens, args) -> Callable[[], None]:
    """The native engine with its dense layers' matrices in FP8 (`rollout.quantization`)."""
    return run_native(model, prompts, out_lens, args, quantization="fp8")


def run_rayrl_hf(model, prompts, out_lens, args) -> Callable[[], None]:
    engine = HFRolloutEngine(model=model)
    ids, mask = padded(sample_rows(prompts, out_lens), "cpu")
    batch = Batch.from_dict(
        {"input_ids": ids, "attention_mask": mask, "uid": [str(i) for i in range(len(ids))]},
        meta={"step": 0},
    )
    params = SamplingParams(max_new_tokens=int(out_lens.max()), ignore_eos=True, seed=1)
    engine.generate(batch[:4], SamplingParams(max_new_tokens=4, ignore_eos=True))

    def run():
        engine.generate(batch, params)

    return run


def run_hf(cache: str):
    def make(model, prompts, out_lens, args) -> Callable[[], None]:
        from transformers import GenerationConfig

        ids, mask = padded(sample_rows(prompts, out_lens), args.device)
        new = int(out_lens.max())
        config = GenerationConfig(
            do_sample=True,
            temperature=1.0,
            top_k=None,
            top_p=None,
            max_new_tokens=new,
            pad_token_id=0,
            eos_token_id=None,
            disable_compile=True,
            cache_implementation="static" if cache == "static" else None,
        )
        warm = GenerationConfig(**{**config.to_dict(), "max_new_tokens": 4})
        model.generate(input_ids=ids[:4], attention_mask=mask[:4], generation_config=warm)

        def run():
            model.generate(input_ids=ids, attention_mask=mask, generation_config=config)

        return run

    return make


ENGINES = {
    "native": run_native,
    "native_sync": run_native_sync,
    "native_fp8": run_native_fp8,
    "rayrl_hf": run_rayrl_hf,
    "hf_dynamic": run_hf("dynamic"),
    "hf_static": run_hf("static"),
}


# ---------------------------------------------------------------- main
def emit(record: dict, out) -> None:
    if QUIET["on"]:
        return
    line = json.dumps(record)
    print(line, flush=True)
    if out:
        out.write(line + "\n")
        out.flush()


def timed(run: Callable[[], None], device: str) -> tuple[float, float]:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    run()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    return seconds, peak


def profile_native(run: Callable[[], None], seconds: float, workload_name: str, out) -> None:
    """Top CUDA kernels of one native run (share of GPU time), and GPU busy time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.self_device_time_total for e in events) or 1
    base = {"bench": "rollout", "workload": workload_name, "engine": "native"}
    emit(
        {
            **base,
            "metric": "gpu_busy_fraction",
            "value": round(total / 1e6 / seconds, 3),
            "unit": "fraction",
            "kernel_seconds": round(total / 1e6, 3),
        },
        out,
    )
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:12]:
        emit(
            {
                **base,
                "metric": "profile_kernel_share",
                "value": round(e.self_device_time_total / total, 4),
                "unit": "fraction",
                "kernel": e.key[:80],
                "calls": e.count,
            },
            out,
        )


def tune_decode(out) -> None:
    """Time the decode-attention kernel's launch settings on A- and B-like contexts
    (256 sequences of 384 and 1100 tokens); keep the fastest for this run."""
    from triton.testing import do_bench

    import rayrl.rollout.native.triton_attention as ta
    from rayrl.rollout.native.step import StepInput

    heads, kv_heads, dim, bs, rows = 14, 2, 64, 16, 256
    width = 1152 // bs
    kc = torch.randn(rows * width, bs, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table = torch.randperm(rows * width, device="cuda", dtype=torch.int32).view(rows, width)
    q = torch.randn(rows, heads, dim, device="cuda", dtype=torch.bfloat16)
    steps = [
        StepInput(
            None,
            None,
            None,
            torch.arange(rows, device="cuda"),
            torch.full((rows,), ctx, device="cuda"),
            table,
            None,
            decode=True,
        )
        for ctx in (384, 1100)
    ]
    attention = ta.TritonAttention()
    timings = {}
    for block_n in (64, 128):
        for warps in (4, 8):
            for stages in (1, 2, 3):
                config = {"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
                ta.DECODE_CONFIG.update(config)
                ms = [
                    do_bench(lambda s=s: attention.decode(q, kc, vc, s, 0.125), warmup=5, rep=20)
                    for s in steps
                ]
                timings[tuple(config.items())] = ms
    best = min(timings, key=lambda k: sum(timings[k]))
    ta.DECODE_CONFIG.update(dict(best))
    for config, ms in timings.items():
        emit(
            {
                "bench": "rollout",
                "metric": "decode_kernel_ms",
                "value": round(sum(ms), 4),
                "unit": "ms",
                "config": dict(config),
                "ctx384_ms": round(ms[0], 4),
                "ctx1100_ms": round(ms[1], 4),
                "chosen": config == best,
            },
            out,
        )


def tune_sampler(out) -> None:
    """Time the fused sampler's launch settings (bench/sampler_kernel.py) on workload A's
    sampling shape; keep the fastest that draws the reference tokens, for this run."""
    from rayrl.rollout.native import triton_sampler as ts
    from sampler_kernel import sweep

    records = sweep(256, reference_05b().vocab_size, temperatures=(1.0,))
    good = [r for r in records if r["tokens_equal_reference"]]
    best = min(good, key=lambda r: r["value"])
    ts._SLICE, ts._BLOCK, ts._WARPS = best["setting"]
    for record in records:
        emit({**record, "chosen": record is best}, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--measure-card",
        action="store_true",
        help="measure the card's bandwidth and bf16 matmul rate at start for the roofline "
        "(default: the table by device name; an unknown card is always measured)",
    )
    parser.add_argument(
        "--shape",
        choices=("reference", "tiny", "moe", "7b", *FAMILIES),
        default=None,
        help="moe: a Qwen3-MoE model of 30B-A3B's layer at 8 layers (`moe_config`); "
        "mistral, gemma2, gemma3: the reference shape as that family (`family_config`)",
    )
    parser.add_argument("--engines", default="native,rayrl_hf,hf_dynamic,hf_static")
    parser.add_argument("--workloads", default="A,B")
    parser.add_argument(
        "--skip", default="", help="engine@workload pairs not to run, e.g. hf_dynamic@B"
    )
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument(
        "--max-num-seqs", type=int, default=None, help="default: 1024 for G, 256 for the others"
    )
    parser.add_argument("--repeats", type=int, default=1, help="timed runs of the native engine")
    parser.add_argument(
        "--warm-prefix",
        action="store_true",
        help="keep the native engine's prefix cache from the warm-up (the same prompts) "
        "into the timed runs; by default it is cleared before each",
    )
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--host-profile",
        action="store_true",
        help="workload M: the engine loop's top Python functions (cProfile, one more rollout)",
    )
    parser.add_argument(
        "--sync-decode",
        action="store_true",
        help="native: commit each decode step before launching the next",
    )
    parser.add_argument("--tune-decode", action="store_true", help="sweep the decode kernel first")
    parser.add_argument(
        "--tune-sampler", action="store_true", help="sweep the sampler kernel first"
    )
    parser.add_argument(
        "--tp", type=int, default=1, help="native: GPUs the model is split over (processes)"
    )
    parser.add_argument(
        "--resume-prefill-cost",
        type=float,
        default=None,
        help="workload M: the native engine's resume_prefill_cost (0: a prefill per answer)",
    )
    parser.add_argument(
        "--prefill-graph-tokens",
        type=int,
        default=None,
        help="workload M: the native engine's prefill_graph_tokens (0: eager prefill steps)",
    )
    parser.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        help="sys.setswitchinterval for the run (seconds; Python's default 0.005)",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    args.shape = args.shape or ("reference" if args.device == "cuda" else "tiny")
    if args.tp > 1 and not set(args.engines.split(",")) <= {"native", "native_sync"}:
        parser.error("--tp above 1 runs the native engines only: --engines native,native_sync")
    if args.tp > 1 and "M" in args.workloads.split(","):
        parser.error("workload M (multi-turn) runs on one-GPU replicas only: --tp 1")
    if args.tp == 1:
        run_bench(args, args.out)
        return
    with socket.socket() as s:  # a free port for the TP group's rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(tp_rank, args=(args, port), nprocs=args.tp)


def tp_rank(rank: int, args: argparse.Namespace, port: int) -> None:
    """One process of a ``--tp`` run: its GPU, the TP group, the benchmark (rank 0 reports)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if args.device == "cuda":
        torch.cuda.set_device(rank)  # "cuda" is this GPU from here on
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=args.tp)
    try:
        args.tp_group = make_tp_groups(args.tp, args.tp).group
        QUIET["on"] = rank > 0
        run_bench(args, args.out if rank == 0 else None)
    finally:
        dist.destroy_process_group()


def run_bench(args: argparse.Namespace, out_path: str | None) -> None:
    """Every workload on every engine asked for; JSON lines printed and added to ``out_path``."""
    out = open(out_path, "a") if out_path else None  # noqa: SIM115
    if args.tune_decode and args.device == "cuda":
        tune_decode(out)
    if args.tune_sampler and args.device == "cuda":
        tune_sampler(out)
    model = build_model(args.shape, args.device)
    card = None
    if args.device == "cuda":
        card = resolve_card(torch.cuda.get_device_name(), getattr(args, "measure_card", False))
    base = {
        "bench": "rollout",
        "shape": args.shape,
        "tp": args.tp,
        "hardware": hardware(args.device),
        # a CPU run's roofline_fraction is against the H200 reference (as it always was)
        **(card or H200).fields(),
        **({} if card else {"gpu": None}),  # no card ran it
        "date": datetime.date.today().isoformat(),
    }
    for name in args.workloads.split(","):
        if name == "M":
            run_multi_turn(model, args, base, lambda record: emit(record, out))
            continue
        prompts, out_lens = workload(name, args.shape, model.config.vocab_size)
        args.workload_name = name
        tokens = int(out_lens.sum())
        rates = {}
        for engine in args.engines.split(","):
            if f"{engine}@{name}" in args.skip.split(","):
                continue
            run = ENGINES[engine](model, prompts, out_lens, args)
            runs = [
                timed(run, args.device)
                for _ in range(args.repeats if engine.startswith("native") else 1)
            ]
            seconds, peak = sorted(runs)[len(runs) // 2]
            rates[engine] = tokens / seconds
            extra = {
                "workload": name,
                "engine": engine,
                "generated_tokens": tokens,
                "seconds": round(seconds, 3),
            }
            native = engine.startswith("native")
            if native:
                extra["overlap_decode"] = run_native.engine.overlap
                extra.update(run_native.engine.last_stats)
                extra["kv_cache_gb"] = round(run_native.engine.cache.nbytes / 2**30, 2)
            target = TARGETS.get(("tokens_per_s", name)) if engine == "native" else None
            record = {
                **base,
                "metric": "tokens_per_s",
                "value": round(rates[engine], 1),
                "unit": "tokens/s",
                **extra,
            }
            if target:
                record.update(target=target, better="higher")
            emit(record, out)
            emit(
                {
                    **base,
                    "metric": "peak_mem_gb",
                    "value": round(peak, 2),
                    "unit": "GiB",
                    "workload": name,
                    "engine": engine,
                },
                out,
            )
            if engine == "native" and args.profile and args.device == "cuda":
                profile_native(run, seconds, name, out)
            if native:
                run_native.engine.sleep()
                del run_native.engine
            torch.cuda.empty_cache() if args.device == "cuda" else None
        if "native" in rates and "native_fp8" in rates:
            emit(
                {
                    **base,
                    "metric": "fp8_over_bf16",
                    "workload": name,
                    "value": round(rates["native_fp8"] / rates["native"], 3),
                    "unit": "x",
                    "target": 1.25,
                    "better": "higher",
                },
                out,
            )
        if "native" in rates and "hf_static" in rates:
            emit(
                {
                    **base,
                    "metric": "speedup_vs_hf_static",
                    "workload": name,
                    "value": round(rates["native"] / rates["hf_static"], 2),
                    "unit": "x",
                    "target": TARGETS["speedup_vs_hf_static"],
                    "better": "higher",
                },
                out,
            )
        if "native" in rates:
            rows = sample_rows(prompts, out_lens)
            # a mixture of experts: the physical limit (the experts the batch touches),
            # and the active-parameter one (each token's experts only) beside it
            for kind in ("touched", "active") if args.shape == "moe" else ("touched",):
                at = card or H200
                ideal = tokens / generation_seconds(model.config, rows, out_lens, at, args.tp, kind)
                metric = "roofline_fraction" + ("_active" if kind == "active" else "")
                emit(
                    {
                        **base,
                        "metric": metric,
                        "workload": name,
                        "engine": "native",
                        "value": round(rates["native"] / ideal, 3),
                        "unit": "fraction",
                        "roofline_tokens_per_s": round(ideal, 1),
                    },
                    out,
                )
    if out:
        out.close()


if __name__ == "__main__":
    main()
