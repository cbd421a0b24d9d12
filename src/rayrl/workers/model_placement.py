"""Where a reward or judge model runs in its worker: the bundle's GPU, else the CPU."""

from __future__ import annotations

import torch

__all__ = ["reward_model_placement"]


def reward_model_placement() -> tuple[str, torch.dtype]:
    """Where the reward model runs: the bundle's GPU in bf16, else the CPU in fp32."""
    if torch.cuda.is_available():
        return f"cuda:{torch.cuda.current_device()}", torch.bfloat16
    return "cpu", torch.float32
