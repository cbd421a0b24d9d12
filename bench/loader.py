"""Prompt loaders side by side: `data.loader=default` vs `data.loader=ray` (Ray Data).

Generates a verl-format parquet file (synthetic arithmetic rows, 1M by default, in
several files), then for each loader measures, in the same run:

- `time_to_first_batch_s`: from constructing the loader (reading, tokenising, set-aside
  checks) to the first prompt batch of epoch 0;
- `rows_per_s`: rows of one whole epoch delivered, per second, construction included;
- `epoch_rows_per_s`: rows per second of a second epoch (the loader already built:
  the default loader reshuffles in memory, the Ray loader re-sorts in the cluster).

Prints one JSON object per line and the ratio ray/default of each figure. Starts its
own local Ray (`--num-cpus`, no dashboard). Usage:
`python bench/loader.py [--rows 1000000] [--files 8] [--batch-size 256]`.
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
import time
from pathlib import Path

from _common import emit_line

BENCH = "loader"


emit = functools.partial(emit_line, BENCH)


def make_files(folder: Path, rows: int, files: int) -> list[str]:
    from rayrl.data import synthetic_rows, write_parquet

    all_rows = synthetic_rows("arithmetic", rows, seed=0)
    per = -(-rows // files)
    return [
        str(write_parquet(all_rows[i * per : (i + 1) * per], folder / f"part-{i}.parquet"))
        for i in range(files)
    ]


def run_loader(name: str, files: list[str], tokenizer, batch_size: int) -> dict[str, float]:
    from rayrl.data import PromptDataset, read_parquet
    from rayrl.data.ray_loader import RayPromptLoader

    start = time.perf_counter()
    if name == "default":
        loader = PromptDataset(read_parquet(files), tokenizer, max_prompt_length=64)
    else:
        loader = RayPromptLoader(files=files, tokenizer=tokenizer, max_prompt_length=64)
    stream = loader.batches(batch_size, epoch=0, seed=1)
    first = next(stream)
    first_s = time.perf_counter() - start
    rows = len(first) + sum(len(b) for b in stream)
    epoch_s = time.perf_counter() - start
    start = time.perf_counter()
    again = sum(len(b) for b in loader.batches(batch_size, epoch=1, seed=1))
    second_s = time.perf_counter() - start
    return {
        "time_to_first_batch_s": first_s,
        "rows_per_s": rows / epoch_s,
        "epoch_rows_per_s": again / second_s,
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--num-cpus", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import ray

    from rayrl.models.tokenizer import train_tokenizer

    tokenizer = train_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        files = make_files(Path(tmp), args.rows, args.files)
        ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
        results = {}
        for name in ("default", "ray"):
            results[name] = run_loader(name, files, tokenizer, args.batch_size)
            for metric, value in results[name].items():
                unit = {"rows": "rows", "time_to_first_batch_s": "s"}.get(metric, "rows/s")
                emit(f"{name}/{metric}", value, unit, rows=args.rows, cpus=args.num_cpus)
        for metric, better in (
            ("time_to_first_batch_s", "lower"),
            ("rows_per_s", "higher"),
            ("epoch_rows_per_s", "higher"),
        ):
            ratio = results["ray"][metric] / results["default"][metric]
            emit(f"ray_vs_default/{metric}", ratio, "ratio", better=better, rows=args.rows)
        ray.shutdown()


if __name__ == "__main__":
    main()
