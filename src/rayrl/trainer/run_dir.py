"""The run directory: where everything a training run makes is kept.

OUTPUT_DIR/
  config.yaml               the resolved config of the run
  metrics.jsonl             one JSON object per step (every metric, with "step")
  rejected_rows.jsonl       every data row set aside at load: split, file, row, reason
  workers.json              each worker's roles, rank, node, pid, Ray log file,
                            torch threads and init span (when its init ran); rewritten
                            when a worker is replaced
  checkpoints/global_step_N/  actor/ (critic/) shards + trainer_state.pt; `latest`
  hf/                       the final Hugging Face export
  val_generations/step_N.jsonl  example validation generations
  tensorboard/, wandb/, mlruns/  tracker outputs, when those trackers are on
  report/                   `rayrl report`'s plots and report.html
  tiny-model/               the demo's model, when no model path is given
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class RunDirError(RuntimeError):
    """The run directory cannot be written (read-only, no permission, not a directory)."""


INFO_KEYS = ("node_id", "host", "pid", "log_file", "threads", "init_span")  # of Worker.info()


@dataclass(frozen=True)
class RunDir:
    """Paths of one run's directory (nothing is created until `prepare`)."""

    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def workers(self) -> Path:
        return self.root / "workers.json"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def rejected_rows(self) -> Path:
        return self.root / "rejected_rows.jsonl"

    @property
    def hf(self) -> Path:
        return self.root / "hf"

    @property
    def val_generations(self) -> Path:
        return self.root / "val_generations"

    @property
    def report(self) -> Path:
        return self.root / "report"

    def prepare(self, config_yaml: str) -> RunDir:
        """Create the directory and write the resolved config."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.config.write_text(config_yaml)
        return self

    def write_workers(self, groups: list[Any], log_dir: str | None) -> None:
        """Where each worker runs and logs (its Ray log file), the roles its process
        holds, its torch threads and when its init ran, for reading after the run."""
        workers = [
            {
                "group": group.role,
                "rank": rank,
                "roles": list(getattr(group.worker_cls, "ROLES", None) or [group.role]),
                **{k: info.get(k) for k in INFO_KEYS},
            }
            for group in groups
            for rank, info in enumerate(group.infos)
        ]
        data = {"ray_log_dir": log_dir, "workers": workers}
        self.workers.write_text(json.dumps(data, indent=2) + "\n")

    def keep_metrics_until(self, step: int) -> None:
        """Drop metrics.jsonl lines after `step` (a resumed run rewrites them)."""
        if not self.metrics.is_file():
            return
        lines = self.metrics.read_text().splitlines()
        kept = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= step]
        self.metrics.write_text("".join(line + "\n" for line in kept))


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl file (a run directory or the file itself)."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; is this a rayrl run directory?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
