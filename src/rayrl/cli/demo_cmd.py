"""`rayrl demo`: GRPO on the synthetic arithmetic task with a tiny model, end to end on
a local embedded Ray: resource pools, the hybrid actor (training + rollout + reference
in one process), the reward worker, advantages, updates. Random weights learn little
in a few steps; the demo shows every stage running, timed, with its metrics."""

from __future__ import annotations

import argparse

from rayrl.cli.common import add_config_args, console, load_from_args

DEMO = [
    "trainer.total_training_steps=8",
    "trainer.output_dir=outputs/demo",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "trainer.resume_mode=disable",  # each demo starts afresh (a train run would resume)
]


def run(args: argparse.Namespace) -> int:
    from rayrl.cli.train_cmd import train

    args.config = args.config or "grpo"  # the built-in GRPO config: tiny model, small sizes
    args.overrides = [*DEMO, *args.overrides]
    cfg = load_from_args(args)
    out = console()
    history = train(cfg, out)
    last = history[-1]
    out.print(
        f"demo done: {len(history)} GRPO steps, last step {last['timing_s/step']:.1f} s, "
        f"score {last['critic/score/mean']:.3f}, {last['perf/throughput']:.0f} tokens/s"
    )
    run_dir = cfg.trainer.output_dir
    out.print(
        f"run directory {run_dir}: config.yaml, metrics.jsonl, checkpoints/, hf/, "
        f"val_generations/; plot it with `rayrl report {run_dir}`"
    )
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("demo", help="run GRPO end to end on a local embedded Ray")
    add_config_args(parser)
    parser.set_defaults(func=run)
