"""Benchmark: the native engine's fused sampler kernel on CUDA, by launch setting.

Times `fused_sample_packed` on workload A's sampling shape (256 rows, the reference
vocabulary, bf16 logits, temperature 1 and 0.7) for several (slice, block, warps)
settings, each checked token for token against `reference_sample_tokens`; with
``--baseline FILE`` also a saved copy of an earlier kernel module, for a side-by-side
figure. Prints JSON lines (``sampler_kernel_ms``, one per variant and temperature).
`bench/rollout.py --tune-sampler` runs the same sweep and keeps the fastest setting.

    python bench/sampler_kernel.py [--rows 256] [--vocab 151936] [--baseline old.py]
"""

from __future__ import annotations

import argparse
import importlib.util
import json

import torch

from rayrl.rollout.native import triton_sampler as ts
from rayrl.rollout.sampling import SamplingParams, reference_sample_tokens, sample_keys

VARIANTS = [
    (8192, 1024, 4),
    (8192, 512, 4),
    (4096, 512, 4),
    (8192, 1024, 8),
    (16384, 1024, 4),
    (4096, 1024, 4),
    (8192, 2048, 8),
]


def sweep(
    rows: int, vocab: int, temperatures=(1.0, 0.7), baseline: str | None = None
) -> list[dict]:
    """One record per (variant, temperature): kernel milliseconds, tokens equal to the reference.
    Leaves the module's launch setting as it found it."""
    from triton.testing import do_bench

    saved = ts._SLICE, ts._BLOCK, ts._WARPS
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(rows, vocab, device="cuda", generator=gen) * 2).bfloat16()
    keys = sample_keys(0, 1, [f"s{i}" for i in range(rows)]).cuda()
    positions = torch.arange(rows, device="cuda")
    kernels = {}
    for setting in VARIANTS:

        def run(p, setting=setting):
            ts._SLICE, ts._BLOCK, ts._WARPS = setting
            return ts.fused_sample_packed(logits, keys, positions, p)

        kernels[setting] = run
    if baseline:
        spec = importlib.util.spec_from_file_location("baseline_sampler", baseline)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
        kernels["baseline"] = lambda p: old.fused_sample_packed(logits, keys, positions, p)
    records = []
    for temperature in temperatures:
        params = SamplingParams(temperature=temperature)
        ref = reference_sample_tokens(logits, keys, positions, params)[0]
        for name, run in kernels.items():
            same = bool(torch.equal(run(params)[0].long(), ref))
            ms = do_bench(lambda r=run, p=params: r(p), warmup=10, rep=50)
            variant = name if name == "baseline" else "slice{}_block{}_warps{}".format(*name)
            records.append(
                {
                    "bench": "sampler_kernel",
                    "metric": "sampler_kernel_ms",
                    "value": round(ms, 4),
                    "unit": "ms",
                    "better": "lower",
                    "variant": variant,
                    "setting": None if name == "baseline" else name,
                    "temperature": temperature,
                    "rows": rows,
                    "vocab": vocab,
                    "tokens_equal_reference": same,
                }
            )
    ts._SLICE, ts._BLOCK, ts._WARPS = saved
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--baseline", default=None, help="path of an earlier triton_sampler.py")
    args = parser.parse_args()
    for record in sweep(args.rows, args.vocab, baseline=args.baseline):
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
