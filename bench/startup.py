"""Start-up and teardown of a small run, each variant measured side by side (issue 15).

Prints one JSON object per line (`bench`, `metric`, `value`, `unit`); every ratio is
the median of per-round ratios, the variants interleaved with their order alternated
each round, so load drifting on a shared machine cancels out:

- `help_import_ratio`, `driver_import_ratio`: this tree against `--base-src` (another
  checkout's `src`, e.g. `git archive <ref> src | tar -x -C DIR`): the wall time of a
  fresh `python -c` that builds `rayrl --help`'s parser, and one that imports what
  `rayrl train` imports before Ray starts (`rayrl.cli.train_cmd`, `rayrl.trainer.ppo`);
- `start_concurrent_ratio`: the demo's roles (hybrid actor, reward worker in its own
  group) created and initialised with `start_groups` against one group after the
  other (`create`, `init`, then the next), on one local Ray; `start_colocated_ratio`:
  the actor with the reward in its process (the CPU default) against the sequential
  start of the two groups;
- `teardown_ratio`: a Ray started by the driver, holding the run's actors and
  placement groups, stopped by `ray_private.stop_local_ray()` against `ray.shutdown()`
  (in a fresh process each: an embedded Ray is what a `rayrl train` stops).

    python bench/startup.py [--rounds 3] [--base-src DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import hardware

BENCH = "startup"
ROOT = Path(__file__).resolve().parents[1]

HELP = "from rayrl.cli.main import build_parser; build_parser()"
DRIVER = "import rayrl.cli.train_cmd, rayrl.trainer.ppo"

TEARDOWN = """
import json, os, sys, time, ray
from ray.util.placement_group import placement_group
ray.init(address="local", num_cpus=2, include_dashboard=True, log_to_driver=False)
pgs = [placement_group([{"CPU": 1}]) for _ in range(2)]
ray.get([pg.ready() for pg in pgs])
@ray.remote(num_cpus=1)
class A:
    def pid(self): return os.getpid()
actors = [A.options(scheduling_strategy=ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy(pg)).remote() for pg in pgs]
ray.get([a.pid.remote() for a in actors])
start = time.perf_counter()
if sys.argv[1] == "rayrl":
    from rayrl.cluster import ray_private
    for a in actors: ray.kill(a)
    for pg in pgs: ray.util.remove_placement_group(pg)
    ray_private.stop_local_ray()
else:
    ray.shutdown()
print(json.dumps({"s": time.perf_counter() - start}))
"""


def emit(obj: dict) -> None:
    print(json.dumps({"bench": BENCH, **obj}), flush=True)


def timed_python(code: str, src: Path, *args: str) -> float:
    env = {**os.environ, "PYTHONPATH": str(src), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return time.perf_counter() - start


def interleaved(rounds: int, a, b) -> tuple[list[float], list[float]]:
    """`rounds` timings of `a` and `b`, alternating which runs first."""
    ta, tb = [], []
    for i in range(rounds):
        if i % 2:
            tb.append(b())
            ta.append(a())
        else:
            ta.append(a())
            tb.append(b())
    return ta, tb


def ratio_line(metric: str, new: list[float], old: list[float], what: str) -> None:
    per_round = [n / o for n, o in zip(new, old, strict=True)]
    emit(
        {
            "metric": metric,
            "value": statistics.median(per_round),
            "unit": "ratio",
            "better": "lower",
            "rounds": per_round,
            "new_s": new,
            "old_s": old,
            "what": what,
        }
    )


def bench_imports(rounds: int, base: Path) -> None:
    here = ROOT / "src"
    for metric, code in (("help_import_ratio", HELP), ("driver_import_ratio", DRIVER)):
        new, old = interleaved(
            rounds, lambda c=code: timed_python(c, here), lambda c=code: timed_python(c, base)
        )
        ratio_line(metric, new, old, f"python -c {code!r}: this tree / {base}")


def bench_teardown(rounds: int) -> None:
    def run(mode: str) -> float:
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "RAY_USAGE_STATS_ENABLED": "0"}
        env.pop("RAY_ADDRESS", None)
        done = subprocess.run(
            [sys.executable, "-c", TEARDOWN, mode],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-2000:])
        return json.loads(done.stdout.strip().splitlines()[-1])["s"]

    new, old = interleaved(rounds, lambda: run("rayrl"), lambda: run("ray"))
    ratio_line("teardown_ratio", new, old, "stop_local_ray() / ray.shutdown(), embedded Ray")


def bench_start(rounds: int) -> None:
    import ray

    from rayrl.cluster.kv import KVStore
    from rayrl.cluster.pool import reserve_pools
    from rayrl.config import load_config
    from rayrl.trainer import roles
    from rayrl.trainer.ppo import PPOTrainer
    from rayrl.trainer.resources import pools_from_config
    from rayrl.trainer.run import Run

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    tmp = Path(tempfile.mkdtemp())

    def start(mode: str) -> float:
        colocate = "true" if mode == "colocated" else "false"
        cfg = load_config(
            "grpo",
            [f"trainer.output_dir={tmp}", f"reward.colocate={colocate}", "trainer.device=cpu"],
        )
        run = Run(PPOTrainer(cfg, print_fn=lambda _: None))
        run.data = run.trainer.load_data()
        run.kv = KVStore.create(run.name)
        run.pools = reserve_pools(pools_from_config(cfg, "cpu"), run.name)
        env = roles.group_env(cfg, run.name, run.kv, run.trainer.pg_timeout_s)
        begin = time.perf_counter()
        if mode == "sequential":
            _start_one_by_one(run, env)
        else:
            run.groups = run.trainer.start(run.pools, env, "cpu", run.total_steps())
        took = time.perf_counter() - begin
        run.shutdown()
        return took

    seq, conc = interleaved(rounds, lambda: start("sequential"), lambda: start("concurrent"))
    ratio_line("start_concurrent_ratio", conc, seq, "start_groups / one group after the other")
    seq, colo = interleaved(rounds, lambda: start("sequential"), lambda: start("colocated"))
    ratio_line(
        "start_colocated_ratio",
        colo,
        seq,
        "actor with the reward in its process / two groups one after the other",
    )
    ray.shutdown()


def _start_one_by_one(run, env) -> None:
    """What setup did before start_groups: create, init, then the next group."""
    from rayrl.trainer import roles

    res = run.cfg.resources

    def one_by_one(groups, **_):
        for group, kwargs in groups:
            group.create(timeout_s=res.create_timeout_s)
            group.init(timeout_s=res.init_timeout_s, retries=res.init_retries, **kwargs)

    original = roles.start_groups
    roles.start_groups = one_by_one
    try:
        run.groups = run.trainer.start(run.pools, env, "cpu", run.total_steps())
    finally:
        roles.start_groups = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--base-src", default=None, help="another checkout's src for imports")
    parser.add_argument("--only", default="imports,teardown,start")
    args = parser.parse_args()
    emit(
        {
            "metric": "load_avg_1m",
            "value": os.getloadavg()[0],
            "unit": "load",
            "when": "start",
            "hardware": hardware(),
        }
    )
    only = set(args.only.split(","))
    if "imports" in only and args.base_src:
        bench_imports(args.rounds, Path(args.base_src))
    if "teardown" in only:
        bench_teardown(args.rounds)
    if "start" in only:
        bench_start(args.rounds)
    emit({"metric": "load_avg_1m", "value": os.getloadavg()[0], "unit": "load", "when": "end"})


if __name__ == "__main__":
    main()
