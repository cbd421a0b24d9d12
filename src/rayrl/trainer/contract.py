"""What a trainer gives the run: its data, its roles, its step and its state.

`rayrl.trainer.run.Run` owns everything every training run has (the run directory,
Ray, the pools, checkpoints and resume, the epoch position, tracking, validation and
export when due, step replay, Ctrl-C, shutdown). A trainer (`PPOTrainer`,
`SFTTrainer`, the next one) supplies only what differs, through the `Trainer`
protocol below: which pools it needs, how its roles start, one step, the driver state
it keeps (`Stateful` parts) and how its roles save and load theirs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rayrl.batch import Batch
from rayrl.cluster.pool import ResourcePool
from rayrl.cluster.spec import PoolSpec
from rayrl.config.schema import RayRLConfig
from rayrl.config.sft import SFTConfig
from rayrl.controller import WorkerGroup
from rayrl.trainer.roles import GroupEnv
from rayrl.trainer.stage_calls import StageCalls
from rayrl.trainer.state import Stateful


@dataclass
class TrainData:
    """A trainer's data: the training set (`batches`, `collate`, `len`), the rows per
    step, whether each epoch is shuffled, the validation set (None: no validation) and
    the seed of the epochs' order (None: `trainer.seed`)."""

    dataset: Any
    batch_size: int
    shuffle: bool = True
    val: Any | None = None
    seed: int | None = None


class Trainer(Protocol):
    """The part of a training run that differs between trainers (module docstring)."""

    kind: str  # in the run's name: "ppo", "sft"
    model_path: str
    print: Callable[[str], None]
    validate_at_end: bool  # validate after the last step even when test_freq <= 0

    @property
    def cfg(self) -> RayRLConfig | SFTConfig:
        """The trainer's config; the run reads its `trainer`, `resources` and `data`."""
        ...

    @property
    def data_needs_ray(self) -> bool:
        """Whether `load_data` needs Ray running (a Ray Data loader)."""
        ...

    @property
    def max_ckpt_to_keep(self) -> int | None: ...

    @property
    def pg_timeout_s(self) -> float | None:
        """The timeout of the process groups its roles form."""
        ...

    def preflight(self) -> None:
        """Check, before Ray starts, the paths the roles will load (models, a reward
        function): a mistake fails at once, with the error the workers would raise."""
        ...

    def load_data(self) -> TrainData: ...

    def pool_specs(self, device: str) -> list[PoolSpec]: ...

    def start(
        self, pools: list[ResourcePool], env: GroupEnv, device: str, total_steps: int
    ) -> list[WorkerGroup]:
        """Create and initialise the roles on the reserved `pools`; every group made."""
        ...

    def stateful_groups(self) -> list[WorkerGroup]:
        """The groups whose state a step changes (snapshotted at step boundaries)."""
        ...

    def parts(self) -> dict[str, Stateful]:
        """Driver-side state beyond the run's own progress and RNGs."""
        ...

    def fingerprint(self) -> dict[str, Any]:
        """What must not change between a run and its resume (the model, the data files,
        the batch geometry, the algorithm), JSON-serialisable; kept with checkpoints."""
        ...

    def step(self, batch: Batch, calls: StageCalls) -> tuple[dict[str, float], list[str]]:
        """One step on `batch`, its group calls made through `calls`; its metrics and
        the prompt uids it trained (the replay ledger)."""
        ...

    def save(self, path: Path) -> None:
        """Have the roles write their state into checkpoint directory `path`."""
        ...

    def load(self, path: Path) -> None:
        """Have the roles read their state from checkpoint directory `path`."""
        ...

    def validate(self, step: int) -> dict[str, float]:
        """Validation metrics of the current model (only called with validation data)."""
        ...

    def export(self, path: Path) -> None:
        """Write the final model as a Hugging Face directory at `path`."""
        ...

    # Optional: `shutdown()`, which `Run.shutdown` calls before it kills the groups, for
    # what a trainer runs beside them (the async trainer's rollout manager and replicas).
