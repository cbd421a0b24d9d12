"""`rayrl rm` and `rayrl dpo`: training on preference pairs (prompt, chosen, rejected),
with a progress bar and a metrics table. `rayrl rm`'s `hf/` is a reward model that
`rayrl train reward_model.enable=true reward_model.model.path=...` scores with;
`rayrl dpo`'s is a policy `rayrl train` starts from."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from rayrl.cli.common import (
    add_config_args,
    console,
    load_pref_from_args,
    plain_printer,
    step_table,
)
from rayrl.cli.running import exit_code_of, run_trainer

if TYPE_CHECKING:
    pass

COLUMNS = {
    "train/loss": "loss",
    "train/rewards/accuracies": "accuracy",
    "train/rewards/margins": "margin",
    "val/loss": "val loss",
    "val/preference_accuracy": "val pref. acc.",
    "train/lr": "lr",
    "timing_s/step": "step s",
}


def train_pairs(cfg, out=None, *, table_rows: int = 20) -> list[dict]:
    """Run `rayrl rm` or `rayrl dpo` (by `cfg.objective.name`) with a progress bar;
    returns the per-step metrics."""
    from rayrl.trainer.pref import PrefTrainer

    out = out or console()
    trainer = PrefTrainer(cfg, print_fn=plain_printer(out))
    run, history = run_trainer(
        trainer,
        out,
        label=trainer.kind,
        info=lambda m: f"loss {m['train/loss']:.3f} acc {m['train/rewards/accuracies']:.2f}",
    )
    out.print(step_table(history, COLUMNS, f"{trainer.kind.upper()} metrics", table_rows))
    line = accuracy_line(run.run_dir.root)
    if line:
        out.print(line)
    if cfg.trainer.export_hf:
        hf = run.run_dir.hf
        if trainer.scored:
            out.print(
                f"reward model: {hf}; score RL with it: `rayrl train reward_model.enable=true "
                f"reward_model.model.path={hf} ...`"
            )
        else:
            out.print(
                f"model: {hf}; start RL from it with `rayrl train "
                f"actor_rollout_ref.model.path={hf} ...`"
            )
    return history


def accuracy_line(run_dir) -> str | None:
    """`val/preference_accuracy` at the run's first and last validation, or None."""
    from rayrl.trainer.run_dir import read_metrics

    rows = [r for r in read_metrics(run_dir) if "val/preference_accuracy" in r]
    if not rows:
        return None
    first, last = rows[0], rows[-1]
    return (
        f"held-out preference accuracy: {first['val/preference_accuracy']:.3f} at step "
        f"{first['step']} -> {last['val/preference_accuracy']:.3f} at step {last['step']}"
    )


def _runner(command: str):
    def run(args: argparse.Namespace) -> int:
        cfg = load_pref_from_args(args, command)
        return exit_code_of(lambda: train_pairs(cfg))

    return run


def register(sub: argparse._SubParsersAction) -> None:
    rm = sub.add_parser(
        "rm",
        help="reward-model training on (prompt, chosen, rejected) pairs (Bradley-Terry)",
    )
    add_config_args(rm, builtins="demo", default="demo")
    rm.set_defaults(func=_runner("rm"))
    dpo = sub.add_parser(
        "dpo",
        help="DPO (or IPO: objective.name=ipo) on (prompt, chosen, rejected) pairs",
    )
    add_config_args(dpo, builtins="demo", default="demo")
    dpo.set_defaults(func=_runner("dpo"))
