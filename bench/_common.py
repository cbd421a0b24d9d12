"""What the bench scripts share: a description of the machine a figure was measured on,
and the JSON line each figure is printed as.

The scripts run as `python bench/<name>.py`, so this folder is on `sys.path`.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from typing import Any, TextIO


def seqs_limit(args: Any, workload: str) -> int:
    """The rollout benches' sequences in flight: ``--max-num-seqs``, else 1,024 for G
    (the trainer's default) and 256 for the others."""
    return args.max_num_seqs or (1024 if workload == "G" else 256)


def cold_prefix(engine: Any, args: Any) -> None:
    """Before a timed rollout: forget the prefix cache's blocks (the warm-up ran the same
    prompts, and its blocks would be found again), unless ``--warm-prefix``. Hits within
    the timed run (a prompt's samples, an episode's turns) still count."""
    if engine.prefix is not None and not getattr(args, "warm_prefix", False):
        engine.prefix.clear()


def hardware(device: str = "cpu") -> str:
    """CPU model and core count, plus the GPU's name on CUDA."""
    model = platform.processor() or "unknown cpu"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    gpu = "no GPU"
    if device == "cuda":
        import torch

        gpu = torch.cuda.get_device_name()
    return f"{model}, {os.cpu_count()} cores, {gpu}"


def gpu_name() -> str | None:
    """The card this process computes on (`torch.cuda.get_device_name`), or None where
    CUDA was not used (a CPU bench)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    return torch.cuda.get_device_name()


def emit_line(
    bench: str, metric: str, value: Any, unit: str, *, stream: TextIO | None = None, **extra
) -> None:
    """Print one figure as a JSON line (`bench`, `metric`, `value`, `unit`, then `extra`,
    and `gpu`: the card's name, unless `extra` gives it) to `stream` (stdout by
    default); a float value is rounded to 4 decimals."""
    if isinstance(value, float):
        value = round(value, 4)
    row = {"bench": bench, "metric": metric, "value": value, "unit": unit, **extra}
    row.setdefault("gpu", gpu_name())
    print(json.dumps(row), file=stream or sys.stdout, flush=True)
