"""The driver's state of a run, in parts that checkpoints save and restore one by one.

A part is `Stateful`: `state_dict()` returns plain data (picklable, no tensors on a
device), `load_state_dict(state)` puts the part back where it was. The run owns two
parts, its `Progress` (steps done, where the data stands) and the driver's RNGs
(`DriverRNG`); a trainer adds its own (PPO: the KL controller). Worker-held state
(weights, optimizer, the workers' RNGs) is not a driver part: the roles write it into
the checkpoint directory themselves (`Trainer.save` / `Trainer.load`).

Step replay uses the same parts: the driver parts are captured before a step and put
back before each retry, so a replayed step starts from exactly the same driver state.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch


@runtime_checkable
class Stateful(Protocol):
    """Something whose state a checkpoint keeps (torch's `Stateful` shape)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class Progress:
    """How far a run is: `global_step` steps done, and the data position of the next.

    The next step reads batch `batch` of epoch `epoch`; `sample` is the same position
    in rows (`batch` x the batch size it was counted with), so a run resumed with
    another `data.train_batch_size` continues at the same row of the epoch (an epoch
    just finished is the next one's position 0: a resume never skips or repeats one).
    A checkpoint from before rows were counted loads with `sample` -1 (unknown).
    """

    global_step: int = 0
    epoch: int = 0
    batch: int = 0
    sample: int = 0

    def describe(self) -> str:
        return f"step {self.global_step}, next epoch {self.epoch} batch {self.batch}"

    def advance(self, meta: dict[str, Any], batch_size: int, batches_per_epoch: int) -> None:
        """Move past the step on a batch: `meta` is the batch's (`step`, `epoch`,
        `batch_index`: `rayrl.trainer.epochs.epoch_batches`); an epoch holds
        `batches_per_epoch` batches of `batch_size` rows."""
        epoch, index = int(meta["epoch"]), int(meta["batch_index"]) + 1
        if index >= batches_per_epoch:
            epoch, index = epoch + 1, 0
        self.global_step, self.epoch = int(meta["step"]) + 1, epoch
        self.batch, self.sample = index, index * batch_size

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.global_step = int(state["global_step"])
        self.epoch = int(state["epoch"])
        self.batch = int(state["batch"])
        self.sample = int(state.get("sample", -1))


class DriverRNG:
    """The controller process's RNGs (Python, NumPy, torch CPU) as a part."""

    def state_dict(self) -> dict[str, Any]:
        return {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            random.setstate(state["python"])
            np.random.set_state(state["numpy"])
            torch.set_rng_state(state["torch"])


def capture(parts: dict[str, Stateful]) -> dict[str, dict[str, Any]]:
    """Every part's state, by name."""
    return {name: part.state_dict() for name, part in parts.items()}


def restore(parts: dict[str, Stateful], states: dict[str, dict[str, Any]]) -> None:
    """Put back every part whose state `states` holds (a part it lacks keeps its own)."""
    for name, part in parts.items():
        if name in states:
            part.load_state_dict(states[name])
