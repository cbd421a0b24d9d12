"""Step metrics with verl's names: batch statistics, reward extras, stage timing, usage.

- `batch_metrics`: `critic/score/mean`, `response_length/*`, `reward/errors`, and
  `reward/<key>/mean` for every numeric extra key a reward function returned in its
  dict (verl's `compute_score` may return `{"score": ..., "acc": ...}`);
- `timer`: adds a stage's wall time to `timing_s/<stage>`;
- `usage_metrics`: per role, the CPU use (percent of one core), GPU utilisation and
  peak memory its workers had during the step (`perf/cpu_util/<role>`,
  `perf/gpu_util/<role>`, `perf/max_memory_allocated_gb/<role>`: peak CUDA memory on
  a GPU, peak resident memory on CPU), and per stage (the worker method)
  `perf/stage_cpu_util/<role>/<stage>`, `perf/stage_gpu_util/<role>/<stage>` (no
  metric name is a prefix of another: file-based trackers need that).
"""

from __future__ import annotations

import math
import numbers
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rayrl.batch import Batch


def batch_metrics(batch: Batch) -> dict[str, float]:
    lengths = batch["response_mask"].sum(-1).float()
    errors = sum(e is not None for e in batch["reward_error"])
    finish = list(batch["finish_reason"])
    metrics = {
        "critic/score/mean": float(batch["scores"].mean()),
        "critic/rewards/mean": float(batch["token_level_rewards"].sum(-1).mean()),
        "response_length/mean": float(lengths.mean()),
        "response_length/clip_ratio": finish.count("length") / max(len(finish), 1),
        "reward/errors": float(errors),
    }
    if "entropy" in batch:
        mask = batch["response_mask"].float()
        metrics["actor/entropy"] = float((batch["entropy"] * mask).sum() / mask.sum().clamp(min=1))
    if "reward_extra" in batch:
        metrics.update(reward_extra_metrics(list(batch["reward_extra"])))
    return metrics


def reward_extra_metrics(extras: list[dict[str, Any]]) -> dict[str, float]:
    """`reward/<key>/mean` over the samples whose reward dict had a numeric `key`."""
    values: dict[str, list[float]] = defaultdict(list)
    for extra in extras:
        for key, value in (extra or {}).items():
            if isinstance(value, numbers.Real) and math.isfinite(float(value)):
                values[key].append(float(value))
    return {f"reward/{k}/mean": sum(v) / len(v) for k, v in sorted(values.items())}


@contextmanager
def timer(timing: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        timing[name] = timing.get(name, 0.0) + time.perf_counter() - start


def usage_metrics(reports: dict[str, list[dict]]) -> dict[str, float]:
    """Per-role (and per-stage) usage metrics from each group's per-rank reports.

    A stage is `role/method`; means are over the ranks that sampled it.
    """
    cpu: dict[str, list[float]] = defaultdict(list)
    gpu: dict[str, list[float]] = defaultdict(list)
    mem: dict[str, list[float]] = defaultdict(list)
    for ranks in reports.values():
        for report in ranks:
            peak_cuda = report.get("max_memory_allocated_gb")
            for stage, s in report.get("stages", {}).items():
                if not s.get("samples"):
                    continue
                role = stage.split("/", 1)[0]
                for key, prefix in ((role, ""), (stage, "stage_")):
                    cpu[f"perf/{prefix}cpu_util/{key}"].append(s["cpu_util"])
                    if s.get("gpu_util") is not None:
                        gpu[f"perf/{prefix}gpu_util/{key}"].append(s["gpu_util"])
                mem[role].append(peak_cuda if peak_cuda is not None else s["rss_gb_max"])
    out = {k: _mean(v) for k, v in cpu.items()}
    out.update({k: _mean(v) for k, v in gpu.items()})
    out.update({f"perf/max_memory_allocated_gb/{k}": max(v) for k, v in mem.items()})
    return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)
