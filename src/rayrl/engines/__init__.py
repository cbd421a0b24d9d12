"""rayrl.engines: the training engine (FSDP2) and the rollout engines.

`TrainEngine` (`rayrl.engines.train`) holds one model for training and log-probs;
`OptimSpec` its optimizer settings. Both load on first use: the driver imports
modules of this package (registries, constants) without the training stack.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"OptimSpec": "rayrl.engines.optim", "TrainEngine": "rayrl.engines.train"}

__all__ = ["OptimSpec", "TrainEngine"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rayrl.engines' has no attribute {name!r}")
