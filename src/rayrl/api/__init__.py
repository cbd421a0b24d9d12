"""The Python API: training from a script or a notebook, in the shape TRL users know.

- `GRPOTrainer(model=..., reward_funcs=[...], train_dataset=...)` and its `train()`
  (`rayrl.api.grpo`), returning a `TrainResult`;
- `rayrl.api.keywords`: TRL's setting names and rayrl's dotted config keys;
- `rayrl.api.datasets`: rows in memory or files, in TRL's columns or rayrl's.

`from rayrl import GRPOTrainer` imports it on first use (`import rayrl` stays light).
"""

from rayrl.api.grpo import GRPOTrainer, TrainResult

__all__ = ["GRPOTrainer", "TrainResult"]
