"""What the bench scripts share: a description of the machine a figure was measured on.

The scripts run as `python bench/<name>.py`, so this folder is on `sys.path`.
"""

from __future__ import annotations

import os
import platform


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
