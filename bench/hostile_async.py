"""Hostile cases of pools and asynchronous training: a pool larger than the machine,
out-of-range async keys, the one collective replica killed again and again
(`bench/hostile.py` runs them)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hostile_run import BASE, SRC, rows, text, train, until, verdict


def rollout_pool_too_large(tmp: Path) -> dict:
    """64 rollout replicas on a CPU-only machine of a few cores: refused by `rayrl
    train` before Ray (exit 2, naming the key) as `rayrl plan` says it never fits; one
    replica still runs (3 logical CPUs on a 2-core machine)."""
    cores = len(os.sched_getaffinity(0))
    if 4 * cores >= 66:
        return {"skipped": f"{cores} cores hold 64 replicas at 4 a core"}
    pool = ["actor_rollout_ref.rollout.mode=async", "rollout.n_gpus_per_node=64"]
    big = train(tmp / "big", *pool, timeout=120)
    env = {**os.environ, "PYTHONPATH": str(SRC), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    plan = subprocess.run(
        [sys.executable, "-m", "rayrl.cli.main", "plan", *BASE, *pool],
        env=env,
        text=True,
        capture_output=True,
        timeout=120,
    )
    key = "Lower rollout.n_gpus_per_node=64"
    said = text(big)
    last = (big.stderr.strip().splitlines() or [""])[-1]  # after the demo model's build
    refused = big.returncode == 2 and last.startswith("resources error:") and key in last
    refused = refused and "Started a local Ray" not in said
    never = plan.returncode == 2 and "NEVER" in text(plan) and key in text(plan)
    one = train(
        tmp / "one",
        "actor_rollout_ref.rollout.mode=async",
        "rollout.n_gpus_per_node=1",
        "trainer.total_training_steps=1",
    )
    ok = refused and never and one.returncode == 0
    return verdict(ok, text(big)[-300:] + " | " + text(plan)[-200:] + " | " + text(one)[-200:])


def async_ranges_without_pool(tmp: Path) -> dict:
    """Out-of-range asynchronous keys with `rollout.mode=async` and no rollout pool
    declared: each one a config error (exit 2) before Ray starts, naming the key."""
    said, ok = [], True
    for key in (
        "async_training.staleness_threshold=-1",
        "async_training.trigger_parameter_sync_step=0",
    ):
        done = train(
            tmp / key.split("=")[0], "actor_rollout_ref.rollout.mode=async", key, timeout=120
        )
        name = key.split("=")[0].split(".")[-1]
        last = (done.stderr.strip().splitlines() or [""])[-1]
        ok = (
            ok and done.returncode == 2 and name in last and "Started a local Ray" not in text(done)
        )
        said.append(last[-200:])
    return verdict(ok, " | ".join(said))


def _descendants(root: int) -> list[int]:
    """Every process below ``root`` (the run's own Ray: its raylet and workers)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _replica_pids(root: int) -> list[int]:
    """The run's rollout replica processes (Ray names them after their class)."""
    pids = []
    for pid in _descendants(root):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        if title.startswith(b"ray::RolloutWorker"):
            pids.append(pid)
    return pids


def collective_replica_killed(tmp: Path) -> dict:
    """An asynchronous run whose one rollout replica takes each version by a broadcast
    (`weight_transport=collective`), the replica SIGKILLed 3 times at random moments of
    training: each loss costs seconds, never the weight-sync timeout (900 s); the run
    ends with every step (exit 0), and a version a replica missed goes by the object
    store instead (counted in `async/weight_transport_fallbacks`)."""
    import random

    out, rng, steps, kills = tmp / "run", random.Random(7), 24, 0
    proc = train(
        out,
        "actor_rollout_ref.rollout.mode=async",
        "rollout.n_gpus_per_node=1",
        "async_training.weight_transport=collective",
        f"trainer.total_training_steps={steps}",
        wait=False,
    )
    for after in (2, 8, 14):  # once training runs: kills spread over the run
        until(lambda n=after: len(rows(out)) >= n or proc.poll() is not None, timeout=600)
        time.sleep(rng.uniform(0.0, 1.0))
        pids = _replica_pids(proc.pid)
        if pids and proc.poll() is None:
            os.kill(pids[0], signal.SIGKILL)
            kills += 1
    output = proc.communicate(timeout=900)[0]
    done = rows(out)
    publish = max((row.get("timing_s/weight_publish", 0.0) for row in done), default=0.0)
    fallbacks = sum(row.get("async/weight_transport_fallbacks", 0) for row in done)
    ok = proc.returncode == 0 and kills == 3 and len(done) == steps and publish < 10.0
    detail = f"exit {proc.returncode}, {kills} kills, {len(done)} steps, longest publish "
    detail += f"{publish:.2f} s, {fallbacks:g} fallback(s); " + output[-300:]
    return verdict(ok, detail)
