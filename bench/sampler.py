"""Benchmark: the seeded sampler's cheap path against its reference definition, on CPU.

`sample_tokens` (what the HF engine and the native engine's CPU path use) against
`reference_sample_tokens` (whole-vocabulary float64 Gumbel-max, a full sort for top-p:
the algorithm the HF engine used before), on the same logits and keys, interleaved;
the ratio is the median of per-repeat ratios. Both draw the same tokens (checked).

    python bench/sampler.py [--rows 16] [--vocab 151936] [--repeats 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from rayrl.rollout.sampling import (
    SamplingParams,
    reference_sample_tokens,
    sample_keys,
    sample_tokens,
)

CASES = {
    "temperature_1": SamplingParams(temperature=1.0),
    "top_k_50": SamplingParams(temperature=1.0, top_k=50),
    "top_p_0.9_peaked": SamplingParams(temperature=1.0, top_p=0.9),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    keys = sample_keys(0, 0, [str(i) for i in range(args.rows)])
    for name, params in CASES.items():
        scale = 4.0 if "peaked" in name else 1.0  # top-p on a trained-like, peaked distribution
        logits = torch.randn(args.rows, args.vocab, generator=gen) * scale
        assert torch.equal(
            sample_tokens(logits, keys, 3, params)[0],
            reference_sample_tokens(logits, keys, 3, params)[0],
        )
        ratios, cheap_ms = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            reference_sample_tokens(logits, keys, 3, params)
            t1 = time.perf_counter()
            sample_tokens(logits, keys, 3, params)
            t2 = time.perf_counter()
            ratios.append((t1 - t0) / (t2 - t1))
            cheap_ms.append((t2 - t1) * 1e3)
        print(
            json.dumps(
                {
                    "bench": "sampler",
                    "metric": "reference_over_cheap_time",
                    "case": name,
                    "value": round(statistics.median(ratios), 2),
                    "unit": "x",
                    "better": "higher",
                    "rows": args.rows,
                    "vocab": args.vocab,
                    "threads": args.threads,
                    "cheap_ms_median": round(statistics.median(cheap_ms), 1),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
