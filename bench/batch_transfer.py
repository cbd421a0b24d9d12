"""Benchmark: a Batch through Ray's object store versus the same data as plain dicts.

Times `ray.get(ray.put(x))` for a rayrl Batch, for a dict holding the same tensors and
lists (which Ray pickles inline), and for a dict of numpy arrays holding the same data
(string columns as fixed-width unicode arrays): Ray's fastest, zero-copy path. The
three are interleaved in a rotating order after a warm-up; each prints its median
milliseconds, and each ratio is the median of the per-repeat ratios, so that load
drifting on a shared machine cancels out. `batch_vs_numpy_ratio` is the one with a
target (1.1): a Batch should cost what its bytes cost.

    python bench/batch_transfer.py [--repeats 15] [--rows 1024] [--cols 1024]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
import uuid

import numpy as np
import torch

from _common import hardware
from rayrl.batch import Batch

MASK_DTYPE = torch.int64  # attention_mask / response_mask: int64, as verl's datasets produce


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


def as_numpy(raw: dict) -> dict:
    """The same data as numpy arrays: tensors as their arrays, strings as unicode arrays."""
    return {k: v.numpy() if isinstance(v, torch.Tensor) else np.array(v) for k, v in raw.items()}


def time_ms(obj) -> float:
    """Milliseconds for one put and get of `obj` (the result is dropped afterwards)."""
    import ray

    start = time.perf_counter()
    ray.get(ray.put(obj))
    return (time.perf_counter() - start) * 1e3


def run(repeats: int, warmup: int, rows: int, cols: int) -> list[dict]:
    import ray

    raw = make_data(rows, cols)
    sides = {"raw": raw, "batch": Batch.from_dict(raw), "numpy": as_numpy(raw)}
    assert ray.get(ray.put(sides["batch"])).equals(sides["batch"]), "Batch round trip"
    for _ in range(warmup):
        for obj in sides.values():
            time_ms(obj)
    ms: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for i in range(repeats):
        for name in names[i % 3 :] + names[: i % 3]:  # rotate who goes first
            ms[name].append(time_ms(sides[name]))

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(ms[a], ms[b], strict=True))

    common = {
        "bench": "batch_transfer",
        "rows": rows,
        "cols": cols,
        "mask_dtype": str(MASK_DTYPE).removeprefix("torch."),
        "repeats": repeats,
        "hardware": hardware(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    lines = [
        {
            **common,
            "metric": f"{name}_put_get_ms",
            "value": round(statistics.median(v), 3),
            "unit": "ms",
        }
        for name, v in ms.items()
    ]
    lines.append(
        {
            **common,
            "metric": "batch_vs_raw_ratio",
            "value": round(ratio("batch", "raw"), 3),
            "unit": "x",
            "target": 1.2,
            "better": "lower",
        }
    )
    lines.append(
        {
            **common,
            "metric": "batch_vs_numpy_ratio",
            "value": round(ratio("batch", "numpy"), 3),
            "unit": "x",
            "target": 1.1,
            "better": "lower",
        }
    )
    return lines


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
