"""Does asynchronous training learn as well? The demo task, synchronous vs async, per seed.

For each seed, `rayrl demo`'s pipeline (`rayrl.cli.demo_cmd.run_pipeline`: the tiny
model, SFT on demonstrations right 30% of the time, then GRPO with the exact reward,
greedy validation on held-out questions) gives the SFT model and the synchronous RL
run; then the same RL stage runs again from the same SFT model with
`actor_rollout_ref.rollout.mode=async` (one rollout replica; staleness 1 by default,
without partial rollouts: verl's one-step-off-policy), for the same number of steps,
so both train on the same number of samples. Prints JSON lines:

- per seed `accuracy_sync`, `accuracy_async` (final greedy validation accuracy) and
  `accuracy_gap_points` (async - sync, in points);
- `mean_gap_points` and `max_abs_gap_points` over the seeds (target: within 2 points).

Usage: `python bench/async_accuracy.py [--seeds 1 2 3] [--staleness 1] [--val-size N]
[--out DIR] [KEY=VALUE ...]` (overrides of the async run). ``--val-size`` sets the
held-out questions of both runs (`data.synthetic_val_size`; the demo's default when
unset): with about 110 of them one validation's own spread is about 5 points. Each seed runs the demo's three stages
and one more RL run: several minutes a seed on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
from pathlib import Path

from _common import emit_line, hardware

BENCH = "async_accuracy"
RESULTS = sys.stdout


emit = functools.partial(emit_line, BENCH, stream=RESULTS)


def async_rl(
    root: Path, seed: int, staleness: float, shared: list[str], extra: list[str], out
) -> float:
    """The demo's RL stage from `root`'s SFT model, asynchronous; its final accuracy."""
    from rayrl.cli.demo_cmd import DemoPlan, _val, stage_configs
    from rayrl.cli.train_cmd import train
    from rayrl.config import load_config

    plan = DemoPlan(root, seed=seed)
    _, _, rl_cfg = stage_configs(plan)
    run_dir = root / "rl_async"
    cfg = load_config(
        "demo",
        [
            f"trainer.seed={seed}",
            "trainer.resume_mode=disable",
            "trainer.logger=[]",
            "trainer.export_hf=false",
            f"trainer.output_dir={run_dir}",
            f"actor_rollout_ref.model.path={root / 'sft' / 'hf'}",
            f"trainer.total_training_steps={rl_cfg.trainer.total_training_steps}",
            "actor_rollout_ref.rollout.mode=async",
            "rollout.n_gpus_per_node=1",
            f"async_training.staleness_threshold={staleness}",
            "async_training.trigger_parameter_sync_step=1",
            "async_training.partial_rollout=false",
            "resources.dashboard=false",
            *shared,
            *extra,
        ],
    )
    import ray

    # one replica and one trainer want 3 CPUs: Ray's counts are logical, so a 2-core
    # machine is declared as 4 (as bench/async_cpu.py does); the run joins this Ray
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        train(cfg, out, table_rows=5)
    finally:
        ray.shutdown()
    return _val(run_dir, last=True)[0]


def main() -> None:
    global RESULTS
    from rayrl.cli.common import console
    from rayrl.cli.demo_cmd import DemoPlan, run_pipeline

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--staleness", type=float, default=1.0)
    parser.add_argument("--val-size", type=int, default=None, help="held-out questions")
    parser.add_argument("--out", default=None)
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE overrides of the async run")
    args = parser.parse_args()
    root = Path(args.out or tempfile.mkdtemp(prefix="rayrl-async-acc-"))
    RESULTS, sys.stdout = sys.stdout, sys.stderr
    out = console(stderr=True)
    gaps = []
    for seed in args.seeds:
        seed_dir = root / f"seed{seed}"
        quiet = ["resources.dashboard=false"]  # no web UI: less to start on a busy machine
        shared = [f"data.synthetic_val_size={args.val_size}"] if args.val_size else []
        plan = DemoPlan(seed_dir, seed=seed, shared=shared, sft=quiet, rl=quiet)
        result = run_pipeline(plan, out)
        sync = result.accuracy["rl"]
        fast = async_rl(seed_dir, seed, args.staleness, shared, args.overrides, out)
        gap = 100.0 * (fast - sync)
        gaps.append(gap)
        tags = {"seed": seed, "val_size": result.val_size, "staleness": args.staleness}
        emit("accuracy_sync", sync, "fraction", **tags)
        emit("accuracy_async", fast, "fraction", **tags)
        emit("accuracy_gap_points", gap, "points", **tags)
    emit("mean_gap_points", statistics.fmean(gaps), "points", seeds=args.seeds)
    if len(gaps) > 1:  # the spread of the mean gap over seeds (its standard error)
        sem = statistics.stdev(gaps) / len(gaps) ** 0.5
        emit("mean_gap_sem_points", sem, "points", seeds=args.seeds)
    emit(
        "max_abs_gap_points",
        max(abs(g) for g in gaps),
        "points",
        target=2,
        better="lower",
        seeds=args.seeds,
        hardware=hardware(),
    )


if __name__ == "__main__":
    main()
