"""rayrl.engines: the training engine (FSDP2) and the rollout engines.

`TrainEngine` (`rayrl.engines.train`) holds one model for training and log-probs;
`OptimSpec` its optimizer settings.
"""

from rayrl.engines.optim import OptimSpec
from rayrl.engines.train import TrainEngine

__all__ = ["OptimSpec", "TrainEngine"]
