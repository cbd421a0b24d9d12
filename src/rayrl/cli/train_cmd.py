"""`rayrl train`: PPO/GRPO training for a config, with a progress bar and a metrics table."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from rayrl.cli.common import add_config_args, console, load_from_args, plain_printer, step_table
from rayrl.cli.running import exit_code_of, run_trainer

if TYPE_CHECKING:
    pass

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
    from rayrl.trainer.async_ppo import AsyncPPOTrainer
    from rayrl.trainer.ppo import PPOTrainer

    out = out or console()
    trainer_cls = AsyncPPOTrainer if cfg.asynchronous else PPOTrainer
    trainer = trainer_cls(cfg, print_fn=plain_printer(out))
    val: dict[str, float] = {}

    def info(metrics: dict) -> str:
        val.update({k: v for k, v in metrics.items() if k.startswith("val-core/")})
        text = f"score {metrics['critic/score/mean']:.3f}"
        acc = [v for k, v in val.items() if "/acc/mean@" in k]
        if acc:
            text += f", val acc {sum(acc) / len(acc):.3f}"
        return text

    run, history = run_trainer(
        trainer, out, label="training", info=info, validate_only=cfg.trainer.val_only
    )
    if cfg.trainer.val_only:
        return _print_validation(run, out)
    if history:
        columns = dict(list(COLUMNS.items())[1:])
        if cfg.distillation.enabled:  # the student's divergence to its teachers
            columns = {**columns, "distillation/reverse_kl": "teacher kl"}
        out.print(step_table(history, columns, "metrics per step", table_rows))
    return history


def _print_validation(run, out) -> list[dict]:
    """`trainer.val_only`: print the validation metrics the run logged; no steps."""
    from rayrl.trainer.run_dir import read_metrics

    last = read_metrics(run.run_dir.metrics)[-1]
    for key, value in last.items():
        if key.startswith("val-core/"):
            out.print(f"{key} = {value:.4g}", highlight=False)
    return []


def run(args: argparse.Namespace) -> int:
    cfg = load_from_args(args)
    return exit_code_of(lambda: train(cfg))


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("train", help="PPO/GRPO training for a config")
    add_config_args(parser)
    parser.set_defaults(func=run)
