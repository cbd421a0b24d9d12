"""Small runs (issue 15): imports at CLI start, groups started side by side, torch
threads from the bundle, the reward in the actor's process on a CPU-only run, a Ray
the run started stopped all at once, and the controller's own time per step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import subprocess_pythonpath
from controller_toys import Echo, reserve
from rayrl.config import load_config
from rayrl.controller import Worker, WorkerGroup, WorkerInitError, register, start_groups
from rayrl.trainer.metrics import controller_overhead
from rayrl.trainer.resources import pools_from_config, reward_colocated

SRC = Path(__file__).resolve().parents[1] / "src"
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _python(code: str, timeout: float = 120) -> str:
    env = {**os.environ, "PYTHONPATH": subprocess_pythonpath(SRC), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_cli_help_and_the_train_driver_import_only_what_they_need():
    loaded = json.loads(
        _python(
            "import json, sys\n"
            "from rayrl.cli.main import build_parser\n"
            "build_parser()\n"
            "help = [m for m in ('torch', 'ray', 'rich', 'transformers') if m in sys.modules]\n"
            "import rayrl.trainer.ppo\n"
            "heavy = ('rayrl.train.engine', 'rayrl.models.tiny', 'torch.distributed.checkpoint',\n"
            "         'transformers.models.qwen2.modeling_qwen2')\n"
            "print(json.dumps([help, [m for m in heavy if m in sys.modules]]))\n"
        )
    )
    assert loaded == [[], []]


class Clocked(Worker):
    """Records when its init ran; init fails on rank `fail_rank`."""

    def init_worker(self, seconds: float = 0.0, fail_rank: int = -1) -> None:
        self.start = time.time()
        time.sleep(seconds)
        self.end = time.time()
        if self.rank == fail_rank:
            raise RuntimeError(f"init of rank {self.rank} failed on purpose")

    @register()
    def span(self) -> tuple[float, float]:
        return self.start, self.end


class Threads(Worker):
    """Loads torch before the group sets its place (as the actor's module does)."""

    def __init__(self) -> None:
        import torch  # noqa: F401

    @register()
    def threads(self) -> tuple[int, str]:
        import torch

        return torch.get_num_threads(), os.environ["OMP_NUM_THREADS"]


@pytest.fixture
def run_name(ray_local):
    return f"start-{uuid.uuid4().hex[:6]}"


def _two_groups(run_name: str, ranks_b: int):
    """Groups "a" (one rank) and "b" (``ranks_b``) of `Clocked` workers, each on its own pool."""
    pools = (reserve(run_name, [1], {"CPU": 0.5}), reserve(f"{run_name}b", [ranks_b], {"CPU": 0.5}))
    groups = [
        WorkerGroup(Clocked, p.bundles, role=r, run=run_name)
        for p, r in zip(pools, "ab", strict=True)
    ]
    return pools, groups


def test_groups_are_created_and_initialised_side_by_side(run_name):
    (pool_a, pool_b), (a, b) = _two_groups(run_name, 1)
    try:
        start_groups(
            [(a, {"seconds": 2.0}), (b, {"seconds": 2.0})], create_timeout_s=120, init_timeout_s=120
        )
        (a0, a1), (b0, b1) = a.span()[0], b.span()[0]
        assert max(a0, b0) < min(a1, b1), "the two inits did not overlap"
    finally:
        a.shutdown(), b.shutdown(), pool_a.teardown(), pool_b.teardown()


def test_a_failed_start_names_its_role_rank_and_phase_and_stops_every_group(run_name):
    (pool_a, pool_b), (a, b) = _two_groups(run_name, 2)
    try:
        with pytest.raises(WorkerInitError) as info:
            start_groups([(a, {}), (b, {"fail_rank": 1})], create_timeout_s=120, init_timeout_s=120)
        err = info.value
        assert (err.phase, err.stage, err.role, err.rank) == ("init", "init_worker", "b", 1)
        assert "failed on purpose" in str(err)
        assert a.actors == [None] and b.actors == [None, None]
    finally:
        pool_a.teardown(), pool_b.teardown()


@pytest.mark.skipif(CORES < 2, reason="needs two cores to tell the thread counts apart")
def test_worker_threads_are_the_cpus_of_its_bundle(run_name):
    pool = reserve(run_name, [1], {"CPU": 2})
    # Ray (or a cluster's environment) says 1 thread: the worker uses its bundle's 2 CPUs.
    group = WorkerGroup(
        Threads,
        pool.bundles,
        role="t",
        run=run_name,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
    )
    try:
        group.create(timeout_s=120)
        assert group.threads() == [(2, "2")]
        assert group.infos[0]["threads"] == 2
    finally:
        group.shutdown(), pool.teardown()


@pytest.mark.parametrize(
    "overrides, colocated",
    [
        ([], True),
        (["reward.colocate=false"], False),
        (["reward.workers_per_node=2"], False),  # several reward workers: processes of their own
        (["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2"], False),
        (
            [
                "reward_model.enable=true",
                "reward_model.model.path=/rm",
                "reward_model.micro_batch_size_per_gpu=2",
            ],
            False,
        ),
    ],
)
def test_the_reward_joins_the_actor_process_only_where_safe(tmp_path, overrides, colocated):
    cfg = load_config("grpo", [f"trainer.output_dir={tmp_path}", *overrides])
    pools = pools_from_config(cfg, "cpu")
    assert reward_colocated(cfg, "cpu") is colocated
    assert [p.name for p in pools] == ["actor_rollout_ref"] + ([] if colocated else ["reward"])
    assert pools[0].bundle["CPU"] == (2.0 if colocated else 1.0)  # the reward's CPU moves
    assert not reward_colocated(cfg, "cuda")


def test_cpus_per_worker_auto_shares_a_gpu_nodes_cpus_among_its_workers(tmp_path):
    """`resources.cpus_per_worker=auto` (the default): on the GPU host of 16 CPUs and one
    GPU a worker gets 10 CPUs (it had 1 and was CPU-starved in generation); 8 GPUs on
    128 CPUs get 10 each; a CPU-only run keeps 1 per rank; a number is taken as it is."""
    from rayrl.config import ConfigError
    from rayrl.trainer.resources import cpus_per_worker, node_cpus

    one_gpu = load_config("grpo", [f"trainer.output_dir={tmp_path}", "trainer.n_gpus_per_node=1"])
    assert one_gpu.resources.cpus_per_worker == "auto"
    assert cpus_per_worker(one_gpu, "cuda", 16) == 10.0
    assert pools_from_config(one_gpu, "cuda", 16)[0].bundle == {"CPU": 10.0, "GPU": 1.0}
    assert cpus_per_worker(one_gpu, "cpu", 16) == 1.0
    assert cpus_per_worker(one_gpu, "cuda", None) == 1.0  # no node known: the old default
    eight = load_config("grpo", ["trainer.n_gpus_per_node=8"], validate=False)
    assert cpus_per_worker(eight, "cuda", 128) == 10.0
    assert cpus_per_worker(eight, "cuda", 4) == 1.0  # never below one
    fixed = load_config("grpo", [f"trainer.output_dir={tmp_path}", "resources.cpus_per_worker=3"])
    assert cpus_per_worker(fixed, "cuda", 16) == 3.0
    totals = {"a": {"CPU": 16.0, "GPU": 1.0}, "b": {"CPU": 64.0, "GPU": 2.0}, "c": {"CPU": 4.0}}
    assert node_cpus(totals, "cuda") == 16.0 and node_cpus(totals, "cpu") == 4.0
    for bad in ("0", "many"):
        with pytest.raises(ConfigError, match="must be auto or a number of CPUs"):
            load_config("grpo", [f"resources.cpus_per_worker={bad}"])


def test_the_ray_a_run_starts_runs_sleeping_omp_threads_and_stops_with_every_process():
    out = json.loads(
        _python(
            "import json, os, time, ray\n"
            "from rayrl.cluster import ray_private\n"
            "from rayrl.config import load_config\n"
            "from rayrl.trainer.ray_session import connect\n"
            "os.environ.pop('OMP_WAIT_POLICY', None)\n"
            "session = connect(load_config('grpo', ['resources.dashboard=false']))\n"
            "@ray.remote(num_cpus=1)\n"
            "class A:\n"
            "    def env(self): return os.getpid(), os.environ.get('OMP_WAIT_POLICY')\n"
            "a = A.remote()\n"
            "pid, policy = ray.get(a.env.remote())\n"
            "from ray._private import worker\n"
            "ray_procs = worker._global_node.all_processes.values()  # the Ray started here\n"
            "pids = [i.process.pid for infos in ray_procs for i in infos] + [pid]\n"
            "start = time.monotonic(); stopped = ray_private.stop_local_ray()\n"
            "took = time.monotonic() - start\n"
            "def alive(pid):\n"
            "    try: return open(f'/proc/{pid}/stat').read().split()[2] != 'Z'\n"
            "    except FileNotFoundError: return False\n"
            "time.sleep(1.0)  # the actor's worker exits once its raylet is gone\n"
            "print(json.dumps({'started': session.started_here, 'policy': policy,\n"
            "                  'driver_policy': os.environ.get('OMP_WAIT_POLICY'),\n"
            "                  'stopped': stopped, 'connected': ray.is_initialized(),\n"
            "                  'alive': [p for p in pids if alive(p)], 'n': len(pids), 's': took}))\n"
        )
    )
    assert out["started"] and out["policy"] == "PASSIVE" and out["driver_policy"] is None
    assert out["stopped"] and not out["connected"] and out["n"] >= 4
    assert out["alive"] == []
    assert out["s"] < 10  # the raylet within 2 s, the rest within half a second


def test_controller_overhead_is_the_step_time_no_worker_was_busy():
    reports = {
        "a": [{"calls": [(1.0, 2.0), (1.5, 3.0)]}, {"calls": [(3.5, 4.0)]}],
        "b": [{"calls": [(0.0, 1.2), (5.5, 9.0)]}, {}],  # outside parts are clipped off
    }
    # busy within 0.5-6.0: 0.5-3.0 (b's first call, then a's overlapping two), 3.5-4.0
    # and 5.5-6.0; idle: 3.0-3.5 and 4.0-5.5
    assert controller_overhead(reports, 0.5, 6.0) == pytest.approx(2.0)
    assert controller_overhead({}, 0.0, 2.0) == 2.0


def test_controller_overhead_of_real_calls_counts_the_gap_between_them(run_name):
    pool = reserve(run_name, [2], {"CPU": 0.5})
    group = WorkerGroup(Echo, pool.bundles, role="echo", run=run_name).create(timeout_s=120)
    try:
        group.usage()  # calls before the "step" are not counted
        start = time.time()
        group.nap(0.3)
        time.sleep(0.2)  # the controller's own work between two calls
        group.nap(0.3)
        end = time.time()
        overhead = controller_overhead({"echo": group.usage()}, start, end)
        assert 0.2 <= overhead <= (end - start) - 0.6
    finally:
        group.shutdown(), pool.teardown()
