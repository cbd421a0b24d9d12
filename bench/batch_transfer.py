"""Benchmark: a Batch through Ray's object store versus the same data as a plain dict.

Times `ray.get(ray.put(x))` for a rayrl Batch and for a dict holding the same tensors
and lists, interleaved (raw, batch, raw, batch, ...) after a warm-up, and prints one
JSON object per line: the median milliseconds of each side and their ratio (median
of the per-repeat ratios, so that load drifting on a shared machine cancels out).

    python bench/batch_transfer.py [--repeats 15] [--rows 1024] [--cols 1024]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
import uuid

import torch

from rayrl.batch import Batch

MASK_DTYPE = torch.int64  # attention_mask / response_mask: int64, as verl's datasets produce


def hardware() -> str:
    """CPU model and core count (the figures here are CPU-only ratios)."""
    model = platform.processor() or "unknown cpu"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    return f"{model}, {os.cpu_count()} cores, no GPU"


def make_data(rows: int, cols: int) -> dict:
    """input_ids plus two masks (rows x cols) and two string columns of `rows` entries."""
    gen = torch.Generator().manual_seed(0)
    response_mask = torch.zeros(rows, cols, dtype=MASK_DTYPE)
    response_mask[:, cols // 2 :] = 1
    return {
        "input_ids": torch.randint(0, 151936, (rows, cols), generator=gen),
        "attention_mask": torch.ones(rows, cols, dtype=MASK_DTYPE),
        "response_mask": response_mask,
        "uid": [str(uuid.UUID(int=i)) for i in range(rows)],
        "data_source": ["openai/gsm8k" if i % 3 else "math" for i in range(rows)],
    }


def time_ms(obj) -> float:
    """Milliseconds for one put and get of `obj` (the result is dropped afterwards)."""
    import ray

    start = time.perf_counter()
    ray.get(ray.put(obj))
    return (time.perf_counter() - start) * 1e3


def run(repeats: int, warmup: int, rows: int, cols: int) -> list[dict]:
    import ray

    raw = make_data(rows, cols)
    batch = Batch.from_dict(raw)
    assert ray.get(ray.put(batch)).equals(batch), "Batch did not survive the round trip"
    for _ in range(warmup):
        time_ms(raw), time_ms(batch)
    raw_ms, batch_ms = [], []
    for i in range(repeats):
        order = (raw, batch) if i % 2 == 0 else (batch, raw)
        for obj in order:
            (raw_ms if obj is raw else batch_ms).append(time_ms(obj))
    ratio = statistics.median(b / r for b, r in zip(batch_ms, raw_ms, strict=True))
    common = {
        "bench": "batch_transfer",
        "rows": rows,
        "cols": cols,
        "mask_dtype": str(MASK_DTYPE).removeprefix("torch."),
        "repeats": repeats,
        "hardware": hardware(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    return [
        {
            **common,
            "metric": "batch_put_get_ms",
            "value": round(statistics.median(batch_ms), 3),
            "unit": "ms",
        },
        {
            **common,
            "metric": "raw_put_get_ms",
            "value": round(statistics.median(raw_ms), 3),
            "unit": "ms",
        },
        {
            **common,
            "metric": "batch_vs_raw_ratio",
            "value": round(ratio, 3),
            "unit": "x",
            "target": 1.2,
            "better": "lower",
        },
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--cols", type=int, default=1024)
    args = parser.parse_args()

    import ray

    # address="local": always start a private instance, never join another user's cluster.
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        logging_level="ERROR",
    )
    try:
        for line in run(args.repeats, args.warmup, args.rows, args.cols):
            print(json.dumps(line), flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
