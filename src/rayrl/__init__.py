"""rayrl: reinforcement-learning post-training of language models on Ray.

`from rayrl import GRPOTrainer` is the Python API (`rayrl.api`), imported on first use so
that `import rayrl` (the command line's start) stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rayrl.api import GRPOTrainer, TrainResult

__version__ = "0.1.0"
__all__ = ["GRPOTrainer", "TrainResult", "__version__"]


def __getattr__(name: str) -> object:
    if name in ("GRPOTrainer", "TrainResult"):
        import rayrl.api

        return getattr(rayrl.api, name)
    raise AttributeError(f"module 'rayrl' has no attribute {name!r}")
