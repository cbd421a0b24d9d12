"""What the driver carries per PPO step as the actor's ranks grow, on fake nodes.

    PYTHONPATH=src python bench/scale_sim.py                  # ranks 2,4,8 on 2 fake nodes
    PYTHONPATH=src python bench/scale_sim.py --ranks 2,4,8,16 --nodes 4 --steps 3

Starts its own `ray.cluster_utils.Cluster` (several raylets on this host, each with
logical CPUs only) and, for each N of `--ranks`, runs the real GRPO trainer
(`Run(PPOTrainer(cfg))`: the real WorkerGroup, dispatch, StageCalls and step) with the
tiny demo model on CPU over N actor ranks spread evenly over the nodes, then shuts it
down. The first step warms up; later steps alternate between counting the driver's
bytes (`rayrl.controller.traffic`) and timing the driver's CPU, so neither disturbs
the other. Prints JSON lines (bench, metric, value, unit, target, better):

- `driver_bytes_ratio` (per N): bytes the driver sent to and fetched from workers in a
  step, serialised as Ray sends them, over the step's batch bytes (the generate
  result as the trainer holds it: its tensors in their own dtypes, its other columns
  serialised); target <= 0.05;
- `controller_s_per_step` (per N): the driver process's CPU seconds in a step
  (`time.process_time`, Ray's threads in the driver included);
- `controller_s_per_step_fit`: a + b*N fitted to those, with the value at N=512;
- `ranks_reloading_on_replace` (per N, unless `--no-kill`): one more step, in which
  one actor rank is SIGKILLed (`rayrl.testing.chaos.ChaosMonkey`) during its update
  (`--kill-stage`: or its generation or log-prob pass);
  how many ranks then read weights from storage to recover (the run's own
  `recovery/ranks_reloading` record); target 1.

Every worker is a full process with torch: mind the memory (about 0.5 GB per rank).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

BENCH = "scale_sim"
ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="2,4,8", help="actor ranks per run, comma-separated")
    p.add_argument("--nodes", type=int, default=2, help="fake nodes (raylets)")
    p.add_argument("--steps", type=int, default=3, help="steps per run (the first warms up)")
    p.add_argument("--rows-per-rank", type=int, default=8, help="samples per rank per step")
    p.add_argument("--n", type=int, default=4, help="samples per prompt (rollout.n)")
    p.add_argument("--prompt-length", type=int, default=64, help="data.max_prompt_length")
    p.add_argument(
        "--response-length",
        type=int,
        default=1024,
        help="data.max_response_length (every response this long: ignore_eos); with short "
        "responses the per-row constants (uids, scores, references) outweigh the tokens",
    )
    p.add_argument(
        "--rows-on-workers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="trainer.rows_on_workers: the step's token columns stay with the workers",
    )
    p.add_argument(
        "--kill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one extra step that kills an actor rank (ranks_reloading_on_replace)",
    )
    p.add_argument(
        "--kill-stage",
        default="update",
        choices=["gen", "log_prob", "update"],
        help="where the extra step's kill lands (rayrl.testing.chaos stages)",
    )
    return p.parse_args(argv)


def start_cluster(nodes: int, ranks: int):
    """A cluster of `nodes` raylets, each with room for its share of `ranks` workers,
    the reward worker and spares (logical CPUs: nothing is pinned)."""
    import ray
    from ray.cluster_utils import Cluster

    cpus = -(-ranks // nodes) + 4
    node = {"num_cpus": cpus, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args=node)
    for _ in range(nodes - 1):
        cluster.add_node(num_cpus=cpus)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    return cluster


def config(ranks: int, nodes: int, out: Path, args: argparse.Namespace):
    """GRPO with a KL loss (so the reference runs) and two mini-batches (so the old
    log-prob pass runs), `rows_per_rank` samples on each of `ranks` ranks."""
    from rayrl.config import load_config

    if ranks % nodes:
        raise SystemExit(f"--ranks {ranks} does not spread evenly over --nodes {nodes}")
    prompts = ranks * args.rows_per_rank // args.n
    if prompts * args.n != ranks * args.rows_per_rank or prompts % 2:
        raise SystemExit("--rows-per-rank x ranks must be an even number of prompts x --n")
    return load_config(
        "grpo",
        [
            f"trainer.output_dir={out}",
            "trainer.device=cpu",
            f"trainer.nnodes={nodes}",
            f"trainer.n_gpus_per_node={ranks // nodes}",
            f"trainer.total_training_steps={args.steps + int(args.kill)}",
            "trainer.val_before_train=false",
            "trainer.export_hf=false",
            "trainer.logger=[]",
            f"trainer.rows_on_workers={str(args.rows_on_workers).lower()}",
            f"data.train_batch_size={prompts}",
            f"data.max_prompt_length={args.prompt_length}",
            f"data.max_response_length={args.response_length}",
            f"actor_rollout_ref.rollout.n={args.n}",
            "actor_rollout_ref.rollout.ignore_eos=true",  # every response full length
            f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts // 2}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.rows_per_rank // 2}",
            f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={args.rows_per_rank}",
            f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={args.rows_per_rank}",
        ],
    )


def measured_trainer(cfg, measured_steps: int):
    """The PPO trainer, its steps measured: the first warms up, then counted bytes and
    timed CPU alternate (`records`: one dict per step after the first). A step after
    `measured_steps` starts `on_extra_step` (the kill) and is not measured."""
    from rayrl.controller import traffic
    from rayrl.trainer.ppo import PPOTrainer

    class Measured(PPOTrainer):
        records: list[dict] = []
        batch_bytes = 0
        seen_steps = 0
        on_extra_step = None

        def step(self, prompts, calls):
            self.seen_steps += 1
            if self.seen_steps > measured_steps:
                if self.seen_steps == measured_steps + 1 and self.on_extra_step:
                    self.on_extra_step()
                return super().step(prompts, calls)
            if self.seen_steps == 1:  # warm-up
                return super().step(prompts, calls)
            if self.seen_steps % 2 == 0:
                with traffic.counting() as seen:
                    out = super().step(prompts, calls)
                self.records.append(
                    {
                        "sent": dict(seen.sent),
                        "received": dict(seen.received),
                        "bytes": seen.total,
                        "batch_bytes": self.batch_bytes,
                    }
                )
                return out
            start = time.process_time()
            out = super().step(prompts, calls)
            self.records.append({"cpu_s": time.process_time() - start})
            return out

        def _generate(self, prompts, ctx, calls, timing, metrics):
            batch = super()._generate(prompts, ctx, calls, timing, metrics)
            if traffic._active:  # a counted step: the batch's size is not timed
                self.batch_bytes = held_nbytes(batch)
            return batch

    Measured.records = []
    return Measured(cfg, print_fn=lambda line: print(line, file=sys.stderr))


def held_nbytes(batch) -> int:
    """The bytes of `batch` as it would be held whole: its tensors' memory (in their own
    dtypes, not narrowed as on the wire; the columns the workers keep fetched for it,
    uncounted) and its other columns serialised."""
    from rayrl.controller import traffic

    with traffic.paused():
        batch = batch.select(*batch.keys()).materialize()
    tensors = sum(t.element_size() * t.numel() for t in batch.tensors.values())
    return tensors + traffic.serialized_nbytes(batch.select(*batch.non_tensors))


def run_one(
    ranks: int, nodes: int, address: str, args: argparse.Namespace
) -> tuple[list[dict], list[dict]]:
    """The measured steps' records and the run's recoveries (from the extra step's kill)."""
    from rayrl.testing.chaos import ChaosMonkey
    from rayrl.trainer.run import Run

    with tempfile.TemporaryDirectory(prefix=f"scale-sim-{ranks}-") as out:
        cfg = config(ranks, nodes, Path(out), args)
        cfg.resources.address = address
        trainer = measured_trainer(cfg, args.steps)
        run = Run(trainer)
        monkeys: list[ChaosMonkey] = []
        if args.kill:  # one actor rank killed while it updates, in the extra step
            kill = ChaosMonkey(run, seed=ranks, stages=[args.kill_stage], kills=1)
            trainer.on_extra_step = lambda: monkeys.append(kill.start())
        try:
            run.setup()
            run.fit()
        finally:
            for monkey in monkeys:
                monkey.stop()
            run.shutdown()
        if args.kill and not (monkeys and monkeys[0].done):
            print(f"scale_sim: N={ranks}: the kill did not land in the extra step", file=sys.stderr)
        return list(trainer.records), list(run.replay.recoveries) if run.replay else []


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares a, b of y = a + b*x (b = 0 for a single point)."""
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    var = sum((x - mean_x) ** 2 for x in xs)
    b = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    return mean_y - b * mean_x, b


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT / "bench"))
    from _common import emit_line, hardware

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    ranks = [int(r) for r in args.ranks.split(",")]
    cluster = start_cluster(args.nodes, max(ranks))
    where = {"hardware": hardware(), "nodes": args.nodes}
    cpu: dict[int, float] = {}
    try:
        for n in ranks:
            started = time.time()
            records, recoveries = run_one(n, args.nodes, cluster.address, args)
            counted = [r for r in records if "bytes" in r]
            timed = [r["cpu_s"] for r in records if "cpu_s" in r]
            shape = {
                "ranks": n,
                "rows": n * args.rows_per_rank,
                "prompt_length": args.prompt_length,
                "response_length": args.response_length,
                "rows_on_workers": args.rows_on_workers,
                "wall_s": round(time.time() - started, 1),
            }
            if counted:
                last = counted[-1]
                emit_line(
                    BENCH,
                    "driver_bytes_ratio",
                    last["bytes"] / last["batch_bytes"],
                    "ratio",
                    target=0.05,
                    better="lower",
                    batch_bytes=last["batch_bytes"],
                    driver_bytes=last["bytes"],
                    sent=last["sent"],
                    received=last["received"],
                    **shape,
                    **where,
                )
            for recovery in recoveries:
                emit_line(
                    BENCH,
                    "ranks_reloading_on_replace",
                    recovery["ranks_reloading"],
                    "ranks",
                    target=1,
                    better="lower",
                    kill_stage=args.kill_stage,
                    replaced=[r["rank"] for r in recovery.get("replaced", [])],
                    bytes_read=sum(
                        b for by_rank in recovery["bytes_read"].values() for b in by_rank.values()
                    ),
                    **shape,
                    **where,
                )
            if timed:
                cpu[n] = min(timed)
                emit_line(
                    BENCH, "controller_s_per_step", cpu[n], "s", better="lower", **shape, **where
                )
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()
    if len(cpu) >= 2:
        a, b = fit_line([float(n) for n in cpu], list(cpu.values()))
        emit_line(
            BENCH,
            "controller_s_per_step_fit",
            a + b * 512,
            "s",
            better="lower",
            at_ranks=512,
            a=round(a, 5),
            b_per_rank=round(b, 6),
            ranks=sorted(cpu),
            **where,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
