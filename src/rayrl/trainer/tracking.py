"""Experiment tracking: `trainer.logger` picks trackers from a registry.

`metrics.jsonl` in the run directory is always written (the `jsonl` tracker; naming
it is allowed and changes nothing). The others:

- `console`: one line per step with the main metrics;
- `tensorboard`: event files under `tensorboard/` (`tensorboard --logdir OUTPUT_DIR`),
  or in `trainer.tensorboard_dir`, else verl's `$TENSORBOARD_DIR`, when set;
- `wandb`: offline by default (a run under `wandb/`, `wandb sync` uploads it later);
  `WANDB_MODE=online` in the environment logs online;
- `mlflow`: a local file store under `mlruns/` (`mlflow ui --backend-store-uri
  OUTPUT_DIR/mlruns`) unless `MLFLOW_TRACKING_URI` points elsewhere;
- `file`: verl's file logger: `{"step": N, "data": {metrics}}` lines in
  `$VERL_FILE_LOGGER_PATH`, else `${VERL_FILE_LOGGER_ROOT:-.}/PROJECT/EXPERIMENT.jsonl`
  (truncated at the start of a run, as verl's);
- `swanlab`: a local run under `swanlog/` by default (verl's `SWANLAB_LOG_DIR` and
  `SWANLAB_MODE` change the directory and the mode: `online` uploads).

`check_trackers` imports each tracker's package up front: a missing one is a
`TrackerUnavailable` that names the extra to install, raised before Ray starts.
"""

from __future__ import annotations

import importlib
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rayrl.registry import Registry

TRACKERS: Registry[type] = Registry("tracker", config_key="trainer.logger")

# tracker -> (module to import, pip extra of rayrl that installs it)
PACKAGES = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
    "swanlab": ("swanlab", "swanlab"),
}


class TrackerUnavailable(RuntimeError):
    """A tracker in trainer.logger whose package is not installed."""


def check_trackers(names: list[str]) -> None:
    """Raise TrackerUnavailable for the first tracker whose package cannot be imported."""
    for name in names:
        TRACKERS.get(name)
        if name not in PACKAGES:
            continue
        module, extra = PACKAGES[name]
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise TrackerUnavailable(
                f"trainer.logger includes {name!r}, but its package {module!r} cannot be "
                f"imported ({exc}); install it with: pip install 'rayrl[{extra}]', or drop "
                f"{name} from trainer.logger"
            ) from None


def numeric(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite-or-not float metrics (bools and strings left out)."""
    return {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }


@TRACKERS.register("jsonl")
class JsonlTracker:
    """Appends one JSON object per step to metrics.jsonl (NaN and inf as null)."""

    def __init__(self, run_dir: Path, **_: Any) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.file = open(self.path, "a")  # noqa: SIM115 - closed in finish()

    def log(self, metrics: dict[str, float], step: int) -> None:
        row = {"step": step, **{k: v if math.isfinite(v) else None for k, v in metrics.items()}}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()

    def finish(self) -> None:
        self.file.close()


@TRACKERS.register("file")
class FileTracker:
    """verl's `file` logger: one `{"step": N, "data": {...}}` line per step, at verl's
    path (see the module docstring; NaN and inf as null)."""

    def __init__(self, project: str, experiment: str, **_: Any) -> None:
        path = os.environ.get("VERL_FILE_LOGGER_PATH")
        if path is None:
            root = os.path.expanduser(os.environ.get("VERL_FILE_LOGGER_ROOT", "."))
            path = os.path.join(root, project, f"{experiment}.jsonl")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "w")  # noqa: SIM115 - closed in finish()

    def log(self, metrics: dict[str, float], step: int) -> None:
        data = {k: v if math.isfinite(v) else None for k, v in metrics.items()}
        self.file.write(json.dumps({"step": step, "data": data}) + "\n")
        self.file.flush()

    def finish(self) -> None:
        self.file.close()


CONSOLE_KEYS = {
    "train/loss": "loss",  # rayrl sft
    "val/loss": "val_loss",
    "critic/score/mean": "score",
    "response_length/mean": "resp_len",
    "actor/pg_loss": "pg_loss",
    "actor/grad_norm": "grad_norm",
    "timing_s/step": "step_s",
}


@TRACKERS.register("console")
class ConsoleTracker:
    """A line per step: the main metrics, and any validation metric of that step."""

    def __init__(self, print_fn: Callable[[str], None] = print, **_: Any) -> None:
        self.print = print_fn

    def log(self, metrics: dict[str, float], step: int) -> None:
        parts = [f"{short}={metrics[k]:.4g}" for k, short in CONSOLE_KEYS.items() if k in metrics]
        parts += [f"{k}={v:.4g}" for k, v in metrics.items() if k.startswith("val-core/")]
        self.print(f"step {step}: " + " ".join(parts))

    def finish(self) -> None:
        pass


@TRACKERS.register("tensorboard")
class TensorboardTracker:
    def __init__(self, run_dir: Path, tensorboard_dir: str | None = None, **_: Any) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=tensorboard_log_dir(run_dir, tensorboard_dir))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


def tensorboard_log_dir(run_dir: Path, configured: str | None = None) -> str:
    """Where the tensorboard tracker writes: ``trainer.tensorboard_dir``, else verl's
    ``$TENSORBOARD_DIR``, else ``OUTPUT_DIR/tensorboard``."""
    return configured or os.environ.get("TENSORBOARD_DIR") or str(Path(run_dir) / "tensorboard")


@TRACKERS.register("wandb")
class WandbTracker:
    def __init__(
        self, run_dir: Path, project: str, experiment: str, config: dict[str, Any], **_: Any
    ) -> None:
        import wandb

        self.run = wandb.init(
            project=project,
            name=experiment,
            config=config,
            dir=str(run_dir),
            # free text that wandb validates itself (its settings take "dryrun" and "run"
            # too); init's annotation lists fewer modes, so mypy cannot follow it
            mode=os.environ.get("WANDB_MODE", "offline"),  # type: ignore[arg-type]
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def finish(self) -> None:
        self.run.finish()


@TRACKERS.register("mlflow")
class MlflowTracker:
    def __init__(
        self, run_dir: Path, project: str, experiment: str, config: dict[str, Any], **_: Any
    ) -> None:
        import mlflow

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # the local file store: MLflow 3 asks for an explicit opt-in to it
            uri = (run_dir / "mlruns").absolute().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment(project)
        self.mlflow = mlflow
        self.run = mlflow.start_run(run_name=experiment)
        mlflow.log_params(_flatten(config))

    def log(self, metrics: dict[str, float], step: int) -> None:
        # MLflow names allow letters, digits and _-. /; verl writes "@" as "_at_" too.
        clean = {k.replace("@", "_at_"): v for k, v in metrics.items()}
        self.mlflow.log_metrics(clean, step=step)

    def finish(self) -> None:
        self.mlflow.end_run()


@TRACKERS.register("swanlab")
class SwanlabTracker:
    def __init__(
        self, run_dir: Path, project: str, experiment: str, config: dict[str, Any], **_: Any
    ) -> None:
        import swanlab

        self.run = swanlab.init(
            project=project,
            name=experiment,
            config=config,
            log_dir=os.environ.get("SWANLAB_LOG_DIR", str(run_dir / "swanlog")),
            mode=os.environ.get("SWANLAB_MODE", "local"),
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def finish(self) -> None:
        self.run.finish()


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)[:500]
    return out


class Tracking:
    """Every tracker the config names, plus metrics.jsonl; `log` fans out to them."""

    def __init__(
        self,
        names: list[str],
        run_dir: Path,
        *,
        project: str,
        experiment: str,
        config: dict[str, Any],
        print_fn: Callable[[str], None] = print,
        tensorboard_dir: str | None = None,
    ) -> None:
        check_trackers(names)
        ordered = ["jsonl", *[n for n in dict.fromkeys(names) if n != "jsonl"]]
        kwargs = {
            "run_dir": Path(run_dir),
            "project": project,
            "experiment": experiment,
            "config": config,
            "print_fn": print_fn,
            "tensorboard_dir": tensorboard_dir,
        }
        self.trackers: list[Any] = []
        try:
            for name in ordered:
                self.trackers.append(TRACKERS.get(name)(**kwargs))
        except BaseException:
            self.finish()
            raise

    def log(self, metrics: dict[str, Any], step: int) -> None:
        values = numeric(metrics)
        for tracker in self.trackers:
            tracker.log(values, step)

    def finish(self) -> None:
        for tracker in self.trackers:
            tracker.finish()
