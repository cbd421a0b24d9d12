"""rayrl.train: the training engine (FSDP2) and what it is built of: device meshes,
sequence parallelism (Ulysses), packing and token budgets, LoRA, checkpoints and the
HF export, step snapshots, and the weights it streams to rollout engines.

`TrainEngine` (`rayrl.train.engine`) holds one model for training and log-probs;
`OptimSpec` its optimizer settings. Both load on first use: the driver imports
modules of this package (registries, constants) without the training stack.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"OptimSpec": "rayrl.train.optim", "TrainEngine": "rayrl.train.engine"}

__all__ = ["OptimSpec", "TrainEngine"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rayrl.train' has no attribute {name!r}")
