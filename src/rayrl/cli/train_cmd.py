"""`rayrl train`: PPO/GRPO training for a config, with a progress bar and a metrics table."""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

from rayrl.cli.common import add_config_args, console, load_from_args

if TYPE_CHECKING:
    from rich.table import Table

COLUMNS = {
    "step": "step",
    "critic/score/mean": "score",
    "response_length/mean": "resp len",
    "actor/pg_loss": "pg loss",
    "actor/kl_loss": "kl",
    "actor/grad_norm": "grad norm",
    "reward/errors": "reward errors",
    "timing_s/step": "step s",
}


def train(cfg, out=None, *, table_rows: int | None = None) -> list[dict]:
    """Run training for `cfg`; shows progress and returns the per-step metrics (the
    table at the end: every step, or `table_rows` of them)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from rayrl.trainer.ppo import PPOTrainer

    out = out or console()
    trainer = PPOTrainer(cfg, print_fn=lambda text: out.print(text, highlight=False))
    out.print(
        f"model: {trainer.model_path}; run {trainer.run}; run directory {cfg.trainer.output_dir}"
    )
    try:
        start = time.perf_counter()
        with out.status("reserving resources and starting workers"):
            trainer.setup()
        out.print(f"ready in {time.perf_counter() - start:.2f} s (Ray, pools, workers, models)")
        if cfg.trainer.val_only:
            return _validate_only(trainer, out)
        total = trainer.total_steps()
        progress = Progress(
            TextColumn("[bold]training"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=out,
        )
        with progress:
            task = progress.add_task("train", total=total, info="")

            val: dict[str, float] = {}

            def on_step(step: int, metrics: dict) -> None:
                val.update({k: v for k, v in metrics.items() if k.startswith("val-core/")})
                info = f"score {metrics['critic/score/mean']:.3f}"
                acc = [v for k, v in val.items() if "/acc/mean@" in k]
                if acc:
                    info += f", val acc {sum(acc) / len(acc):.3f}"
                progress.update(task, completed=step + 1, info=info)

            history = trainer.fit(on_step=on_step)
    finally:
        start = time.perf_counter()
        trainer.shutdown()
        out.print(f"stopped in {time.perf_counter() - start:.2f} s (workers, pools, Ray)")
    if history:
        out.print(metrics_table(history, table_rows))
    if trainer.stopped:
        raise Stopped(trainer.state.global_step)
    return history


class Stopped(Exception):  # noqa: N818 - the user's request, not an error
    """The run stopped early on Ctrl-C, after writing a checkpoint."""


def _validate_only(trainer, out) -> list[dict]:
    """`trainer.val_only`: validate, print the validation metrics; no steps."""
    from rayrl.trainer.run_dir import read_metrics

    with out.status("validating"):
        trainer.fit()
    last = read_metrics(trainer.run_dir.metrics)[-1]
    for key, value in last.items():
        if key.startswith("val-core/"):
            out.print(f"{key} = {value:.4g}", highlight=False)
    return []


def metrics_table(history: list[dict], rows: int | None = None) -> Table:
    """Every step, or up to `rows` evenly spaced ones (the last included)."""
    from rich.table import Table

    table = Table(title="metrics per step")
    for title in COLUMNS.values():
        table.add_column(title, justify="right")
    every = max(1, -(-len(history) // rows)) if rows else 1
    for i, metrics in enumerate(history):
        if i % every and i != len(history) - 1:
            continue
        row = [str(int(metrics["training/global_step"]))]
        for key in list(COLUMNS)[1:]:
            value = metrics.get(key)
            row.append("-" if value is None else f"{value:.4g}")
        table.add_row(*row)
    return table


def run(args: argparse.Namespace) -> int:
    from rich.markup import escape

    from rayrl.data import DataError
    from rayrl.trainer.tracking import TrackerUnavailable

    cfg = load_from_args(args)
    try:
        train(cfg)
    except DataError as exc:  # raised at load, before any resource is reserved
        console(stderr=True).print(f"[bold red]data error:[/] {escape(str(exc))}", highlight=False)
        return 2
    except TrackerUnavailable as exc:  # raised before Ray starts
        console(stderr=True).print(f"[bold red]tracker error:[/] {escape(str(exc))}")
        return 2
    except Stopped:
        return 130  # the shell's code for a run ended by Ctrl-C
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("train", help="PPO/GRPO training for a config")
    add_config_args(parser)
    parser.set_defaults(func=run)
