"""`rayrl sft`: supervised fine-tuning on (prompt, response) pairs, with a progress bar
and a metrics table; its `hf/` is a model directory `rayrl train` starts from."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from rayrl.cli.common import add_config_args, console, load_sft_from_args, plain_printer, step_table
from rayrl.cli.running import exit_code_of, run_trainer

if TYPE_CHECKING:
    pass

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
    from rayrl.trainer.sft import SFTTrainer

    out = out or console()
    trainer = SFTTrainer(cfg, print_fn=plain_printer(out))
    run, history = run_trainer(
        trainer, out, label="sft", info=lambda metrics: f"loss {metrics['train/loss']:.3f}"
    )
    out.print(step_table(history, COLUMNS, "SFT metrics", table_rows))
    if cfg.trainer.export_hf:
        out.print(
            f"model: {run.run_dir.hf}; start RL from it with `rayrl train "
            f"actor_rollout_ref.model.path={run.run_dir.hf} ...`"
        )
    return history


def run(args: argparse.Namespace) -> int:
    cfg = load_sft_from_args(args)
    return exit_code_of(lambda: sft(cfg))


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "sft", help="supervised fine-tuning on (prompt, response) pairs (verl's SFT keys)"
    )
    add_config_args(parser, builtins="demo", default="demo")
    parser.set_defaults(func=run)
