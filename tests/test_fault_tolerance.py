"""Fault tolerance through the product path, with the real roles (PPO: the hybrid actor /
rollout / reference and the critic in one process per rank, two ranks; the reward
worker) and real processes killed:

- a clean run is the reference;
- a rank SIGKILLed mid-update is replaced, and only it reads weights from storage
  (its shard of the frozen reference policy): the survivor keeps its own; the run
  ends bitwise identical to the clean run;
- on a two-node cluster, the chaos monkey SIGKILLs workers by pid at random points,
  a hang is injected (the watchdog catches it), then a whole node is lost: the run
  ends bitwise identical to the clean run;
- on a two-node cluster with `trainer.snapshot_replicas=1`, the node that holds a
  rank's step snapshot is lost: the rank comes back from the copy on the other node
  (one step back, no rewind to a checkpoint), bitwise identical to the clean run;
- a rank killed while it hands its step snapshot to the object store: the run goes
  back to the boundary before, kept in memory, and ends bitwise identical;
- `rayrl train` in its own process: SIGTERM stops it with a checkpoint, a second run
  is SIGKILLed mid-step, a third (`trainer.resume_mode=auto`) ends identical;
- a rank that always dies hits `trainer.max_worker_restarts` and the run stops.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray

from conftest import start_local_ray, subprocess_pythonpath
from rayrl.config import load_config
from rayrl.testing.chaos import (
    ChaosMonkey,
    compare_runs,
    deterministic,
    engine_numerics_apart,
    final_weights,
)
from rayrl.testing.faults import Fault, inject
from rayrl.trainer.ppo import PPOTrainer
from rayrl.trainer.replay import WorkerRestartLimitError
from rayrl.trainer.run import Run

pytestmark = pytest.mark.slow
SRC = Path(__file__).resolve().parents[1] / "src"
STEPS = 3
RUN = [
    "data.train_batch_size=2",
    "data.max_response_length=8",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=1",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
    "critic.ppo_mini_batch_size=1",
    "critic.ppo_micro_batch_size_per_gpu=1",
    "trainer.device=cpu",
    f"trainer.total_training_steps={STEPS}",
    "trainer.val_before_train=false",
    "trainer.logger=[jsonl]",
    "trainer.save_freq=1",
    "trainer.resume_mode=auto",
]
ONE_NODE = ["trainer.n_gpus_per_node=2"]


def _run(out: Path, extra: list[str], before_fit=None, on_step=None) -> dict:
    cfg = load_config("ppo", [*RUN, *extra, f"trainer.output_dir={out}"])
    printed: list[str] = []
    run = Run(PPOTrainer(cfg, print_fn=printed.append))
    helper = None
    try:
        run.setup()
        helper = before_fit(run) if before_fit else None
        history = run.fit(on_step=on_step and (lambda s, m: on_step(run, s)))
    finally:
        if helper is not None:
            helper.stop()
        run.shutdown()
    return {
        "history": history,
        "ledger": run.replay.ledger,
        "weights": final_weights(out),
        "printed": printed,
        "recoveries": run.replay.recoveries,
        "helper": helper,
        "out": out,
        "group": run.trainer.roles.hybrid.name,
    }


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    start_local_ray()
    return _run(tmp_path_factory.mktemp("clean"), ONE_NODE)


def _train_cmd(out: Path, address: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "rayrl.cli.main",
        "train",
        "-c",
        "ppo",
        *RUN,
        *ONE_NODE,
        f"trainer.output_dir={out}",
        f"resources.address={address}",
    ]


def _rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _until(predicate, proc, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"exited with {proc.returncode}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_sigterm_then_a_killed_driver_then_resume_end_like_the_clean_run(clean, tmp_path):
    """SIGTERM (how Slurm and Kubernetes stop a job) gets a first Ctrl-C's safe stop with a
    checkpoint; a second run on the same directory meanwhile is refused, naming the first."""
    from rayrl.cli.main import main

    address = start_local_ray().get_runtime_context().gcs_address
    out = tmp_path / "run"
    first = _Driver(_train_cmd(out, address))
    _until(lambda: len(_rows(out)) >= 1, first.proc)
    # Paused (alive, holding its lock) while the rival starts: on a loaded machine the
    # rival's start took longer than the first run's remaining steps.
    first.proc.send_signal(signal.SIGSTOP)
    rival = subprocess.run(_train_cmd(out, address), capture_output=True, text=True, timeout=240)
    assert rival.returncode == 2, rival.stdout[-2000:] + rival.stderr[-2000:]
    assert f"pid {first.proc.pid}" in rival.stderr and "in use by another run" in rival.stderr
    first.proc.send_signal(signal.SIGTERM)  # pending until it continues
    first.proc.send_signal(signal.SIGCONT)
    assert first.proc.wait(timeout=240) == 143, first.text()[-3000:]
    assert "stopped by SIGTERM after step" in first.text(), first.text()[-3000:]
    assert (out / "checkpoints" / "latest").is_file()

    second = _Driver(_train_cmd(out, address))
    _until(lambda: "resumed from" in second.text(), second.proc)
    time.sleep(1.5)  # inside its first step
    assert second.proc.poll() is None, second.text()[-3000:]
    second.proc.kill()  # SIGKILL: no handler, no teardown; Ray ends the job's workers
    second.proc.wait(timeout=60)
    assert main(["train", "-c", "ppo", *RUN, *ONE_NODE, f"trainer.output_dir={out}"]) == 0
    assert compare_runs(clean, {"weights": final_weights(out), "history": [], "ledger": []})[
        "weights_identical"
    ]
    # every metric but wall-clock ones; the engine's probability diagnostics within ENGINE_TOLERANCE
    assert _by_step(out) == _by_step(clean["out"])
    rows = {r["step"]: r for r in _rows(clean["out"])}
    apart = {r["step"]: engine_numerics_apart(rows[r["step"]], r) for r in _rows(out)}
    assert not any(apart.values()), apart


class _Driver:
    """`rayrl train` in its own process; its output collected as it comes."""

    def __init__(self, cmd: list[str]) -> None:
        env = {
            **os.environ,
            "PYTHONPATH": subprocess_pythonpath(SRC),
            "RAY_USAGE_STATS_ENABLED": "0",
        }
        self.proc = subprocess.Popen(
            cmd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()

    def text(self) -> str:
        return "".join(self.lines)


def _by_step(out: Path) -> dict[int, dict]:
    return {r["step"]: deterministic(r) for r in _rows(out)}


def test_a_rank_that_always_dies_stops_the_run_at_the_restart_bound(tmp_path):
    start_local_ray()

    def always_dies(run):
        inject(run.trainer.roles.hybrid, Fault("compute_log_prob", "kill", ranks=(0,), times=None))

    with pytest.raises(WorkerRestartLimitError) as info:
        _run(
            tmp_path,
            ["trainer.n_gpus_per_node=1", "trainer.max_worker_restarts=1"],
            before_fit=always_dies,
        )
    text = str(info.value)
    assert "rank 0 failed 2 times in 'compute_log_prob'" in text, text
    assert "trainer.max_worker_restarts=1" in text and "worker log: /" in text and "node " in text


@pytest.mark.timeout(900)  # a two-node cluster and six recoveries on a loaded 2-core machine
def test_kills_a_hang_and_a_lost_node_end_bitwise_like_the_clean_run(
    clean, ray_multinode, tmp_path
):
    cluster = ray_multinode([{"num_cpus": 5}, {"num_cpus": 5}])
    head = ray.get_runtime_context().get_node_id()

    def start(run):  # step 0: a kill by pid at a random point
        return ChaosMonkey(
            run, seed=3, stages=["gen", "log_prob", "update"], kills=1, steps=[0]
        ).start()

    def on_step(run, step):
        hybrid = run.trainer.roles.hybrid
        if step == 0:  # step 1: rank 0's critic never returns from compute_values
            hybrid.stage_timeout_s = 3.0
            inject(hybrid, Fault("compute_values", "hang", ranks=(0,)))
        if step == 1:  # step 2: the node of the rank not on the head goes away mid-update
            hybrid.stage_timeout_s = 120.0  # a checkpoint load reports no progress
            threading.Thread(target=_lose_node, args=(cluster, hybrid, head), daemon=True).start()

    ray.shutdown()  # the trainer connects through resources.address, as a user would
    chaos = _run(
        tmp_path,
        [
            f"resources.address={cluster.address}",
            "trainer.nnodes=2",
            "trainer.n_gpus_per_node=1",
            "resources.capacity_factor=2",  # spares SPREAD: each pool has one on either node
            # a reward worker on each node (and its spares) in half a CPU: 9 of the 10
            "reward.cpus_per_worker=0.5",
        ],
        before_fit=start,
        on_step=on_step,
    )
    verdict = compare_runs(clean, chaos)
    assert verdict["weights_identical"] and verdict["ledger_identical"], verdict
    assert verdict["metrics_identical"] and not verdict["trained_twice"], verdict
    assert verdict["engine_numerics_close"], verdict
    assert len(chaos["helper"].done) == 1, chaos["printed"]  # the monkey's kill
    text = "\n".join(chaos["printed"])
    assert "call of 'compute_values' hung on role 'critic (in actor_rollout_ref)' rank 0" in text, (
        text
    )
    assert "moved from node" in text, text  # the lost node's ranks went to spares
    stages = [r["stage"] for r in chaos["recoveries"]]
    assert "compute_values" in stages and len(stages) >= 3, stages


def test_a_killed_rank_alone_reads_weights_and_the_run_ends_bitwise(clean, tmp_path):
    start_local_ray()

    def on_step(run, step):  # step 1: rank 1 dies as its update starts
        if step == 0:
            inject(run.trainer.roles.hybrid, Fault("update_actor", "kill", ranks=(1,)))

    killed = _run(tmp_path, ONE_NODE, on_step=on_step)
    verdict = compare_runs(clean, killed)
    assert verdict["weights_identical"] and verdict["ledger_identical"], verdict
    assert verdict["metrics_identical"], verdict
    [record] = killed["recoveries"]
    assert record["stage"] == "update_actor" and record["replaced"][0]["rank"] == 1
    read = record["bytes_read"][killed["group"]]
    checkpoint = (tmp_path / "tiny-model" / "model.safetensors").stat().st_size
    assert read[0] == 0, read  # the survivor rebuilt on the shards it held
    assert 0 < read[1] < 0.75 * checkpoint, (read, checkpoint)  # its reference's shard
    assert record["ranks_reloading"] == 1
    assert killed["history"][1]["recovery/ranks_reloading"] == 1.0
    assert "1 rank(s) read weights from storage" in "\n".join(killed["printed"])


def test_a_rank_killed_while_its_boundary_is_stored_goes_back_a_boundary_and_ends_bitwise(
    clean, tmp_path
):
    """Rank 1 dies as it starts handing step 2's snapshot to the object store (its
    `snapshot_publish`, beside what follows the step): that snapshot is gone, so the
    groups and the driver go back to step 1's boundary, kept in memory until step 2's
    was stored, and steps 2 and 3 run again; no checkpoint is read, and the run ends
    bitwise like the clean one."""
    start_local_ray()

    def on_step(run, step):  # after step 1: the next hand-over (step 2's) kills rank 1
        if step == 0:
            inject(run.trainer.roles.hybrid, Fault("snapshot_publish", "kill", ranks=(1,)))

    killed = _run(tmp_path, ONE_NODE, on_step=on_step)
    verdict = compare_runs(clean, killed)
    assert verdict["weights_identical"] and verdict["ledger_identical"], verdict
    assert verdict["metrics_identical"] and not verdict["trained_twice"], verdict
    text = "\n".join(killed["printed"])
    assert "back to the boundary before it (step 1)" in text, text
    assert "rewound to" not in text, text
    [record] = killed["recoveries"]
    assert record["back_to"] == 1 and record["replaced"][0]["rank"] == 1, record
    assert [row["training/global_step"] for row in killed["history"]] == [1, 2, 3]


@pytest.mark.timeout(900)  # a two-node cluster and a node lost on a loaded 2-core machine
def test_a_lost_nodes_snapshot_comes_back_from_its_copy_on_the_other_node(
    clean, ray_multinode, tmp_path
):
    cluster = ray_multinode([{"num_cpus": 5}, {"num_cpus": 5}])
    head = ray.get_runtime_context().get_node_id()
    seen: dict = {}

    def on_step(run, step):  # step 1: the worker node goes, with its rank's snapshot
        if step == 0:
            hybrid = run.trainer.roles.hybrid
            snapshot = run.replay.snapshots[hybrid.name]
            threading.Thread(
                target=_lose_node, args=(cluster, hybrid, head, snapshot, seen), daemon=True
            ).start()

    ray.shutdown()
    lost = _run(
        tmp_path,
        [
            f"resources.address={cluster.address}",
            "trainer.nnodes=2",
            "trainer.n_gpus_per_node=1",
            "resources.capacity_factor=2",
            "trainer.snapshot_replicas=1",
        ],
        on_step=on_step,
    )
    # before the loss: the rank's snapshot on its own node, its copy on the head
    assert seen["node"] in seen["primary"] and seen["replica"] == [head], seen
    verdict = compare_runs(clean, lost)
    assert verdict["weights_identical"] and verdict["ledger_identical"], verdict
    text = "\n".join(lost["printed"])
    assert "restored from the step snapshot's copies on other nodes" in text, text
    assert "rewound to" not in text, text
    copies = [r["from_replicas"] for r in lost["recoveries"] if "from_replicas" in r]
    assert copies == [{lost["group"]: {seen["rank"]: head}}], lost["recoveries"]


def _lose_node(cluster, group, head: str, snapshot=None, seen: dict | None = None) -> None:
    """Remove the worker node once rank 1 (not on the head) is inside update_actor;
    with `snapshot`, once its copies are stored, noting in `seen` where its rank's
    snapshot and copy lie."""
    rank = next(r for r in range(group.world_size) if group.describe(r).node_id != head)
    if snapshot is not None:
        from ray.experimental import get_object_locations

        copies = snapshot.replicas[rank]
        ray.wait(copies, num_returns=len(copies), timeout=120, fetch_local=False)
        places = get_object_locations([snapshot.refs[rank], *snapshot.replicas[rank]])
        seen.update(
            rank=rank,
            node=group.describe(rank).node_id,
            primary=places[snapshot.refs[rank]]["node_ids"],
            replica=places[snapshot.replicas[rank][0]]["node_ids"],
        )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            beat = ray.get(group.actors[rank].heartbeat.remote(), timeout=5)
        except Exception:  # noqa: BLE001 - being replaced
            beat = {}
        if (beat.get("busy") or "").endswith("update_actor"):
            break
        time.sleep(0.01)
    node = group.describe(rank).node_id
    cluster.remove_node(next(n for n in cluster.list_all_nodes() if n.node_id == node))
