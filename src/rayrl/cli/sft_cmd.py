"""`rayrl sft`: supervised fine-tuning on (prompt, response) pairs, with a progress bar
and a metrics table; its `hf/` is a model directory `rayrl train` starts from."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from rayrl.cli.common import add_config_args, console, load_sft_from_args

if TYPE_CHECKING:
    from rich.table import Table

COLUMNS = {
    "train/loss": "loss",
    "val/loss": "val loss",
    "train/lr": "lr",
    "train/grad_norm": "grad norm",
    "perf/throughput": "tokens/s/GPU",
    "timing_s/step": "step s",
}


def sft(cfg, out=None, *, table_rows: int = 20) -> list[dict]:
    """Run SFT for `cfg` with a progress bar; returns the per-step metrics."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from rayrl.trainer.sft import SFTTrainer

    out = out or console()
    trainer = SFTTrainer(cfg, print_fn=lambda text: out.print(text, highlight=False))
    out.print(
        f"model: {trainer.model_path}; run {trainer.run}; run directory {cfg.trainer.output_dir}"
    )
    try:
        with out.status("reserving resources and starting the SFT workers"):
            trainer.setup()
        progress = Progress(
            TextColumn("[bold]sft"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=out,
        )
        with progress:
            task = progress.add_task("sft", total=trainer.total_steps(), info="")

            def on_step(step: int, metrics: dict) -> None:
                progress.update(task, completed=step + 1, info=f"loss {metrics['train/loss']:.3f}")

            history = trainer.fit(on_step=on_step)
    finally:
        trainer.shutdown()
    out.print(metrics_table(history, table_rows))
    if cfg.trainer.export_hf:
        out.print(
            f"model: {trainer.run_dir.hf}; start RL from it with `rayrl train "
            f"actor_rollout_ref.model.path={trainer.run_dir.hf} ...`"
        )
    return history


def metrics_table(history: list[dict], rows: int) -> Table:
    """Up to `rows` evenly spaced steps (the last one included)."""
    from rich.table import Table

    table = Table(title="SFT metrics")
    for title in ("step", *COLUMNS.values()):
        table.add_column(title, justify="right")
    every = max(1, -(-len(history) // rows))
    shown = [m for i, m in enumerate(history) if i % every == 0 or i == len(history) - 1]
    for metrics in shown:
        cells = [f"{metrics[k]:.4g}" if metrics.get(k) is not None else "-" for k in COLUMNS]
        table.add_row(str(int(metrics["training/global_step"])), *cells)
    return table


def run(args: argparse.Namespace) -> int:
    from rich.markup import escape

    from rayrl.data import DataError
    from rayrl.trainer.tracking import TrackerUnavailable

    cfg = load_sft_from_args(args)
    try:
        sft(cfg)
    except (DataError, FileNotFoundError) as exc:  # raised at load, before Ray starts
        console(stderr=True).print(f"[bold red]data error:[/] {escape(str(exc))}", highlight=False)
        return 2
    except TrackerUnavailable as exc:  # raised before Ray starts
        console(stderr=True).print(f"[bold red]tracker error:[/] {escape(str(exc))}")
        return 2
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "sft", help="supervised fine-tuning on (prompt, response) pairs (verl's SFT keys)"
    )
    add_config_args(parser, builtins="demo", default="demo")
    parser.set_defaults(func=run)
