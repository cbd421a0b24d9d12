"""Shared fixtures: one real local Ray per test session, tiny models, multi-node clusters.

Ray workers are separate processes: they import test modules by name, so the tests
folder is put on PYTHONPATH before Ray starts (toy worker classes live in test files).
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in [str(TESTS), str(SRC), os.environ.get("PYTHONPATH", "")] if p
)
# Keep Ray quiet and light on a 2-core machine.
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as `rayrl train`'s Ray (ray_session)
# Triton's CPU interpreter (test_rollout_native_triton.py) needs TRITON_INTERPRET before
# anything imports Triton (transformers does, when Triton is installed): set it first,
# where no GPU is visible (on a GPU the kernels must run for real). Checking CUDA this
# way initialises no CUDA context.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(TESTS))

LOCAL_RAY = dict(
    address="local", num_cpus=8, num_gpus=4, include_dashboard=False, log_to_driver=False
)


def start_local_ray():
    """Start (or reuse) the session's local Ray: 8 logical CPUs and 4 logical GPUs."""
    import ray

    if ray.is_initialized():
        if ray.get_runtime_context().gcs_address == _state.get("local_gcs"):
            return ray
        ray.shutdown()
    with fake_gpus_for_ray():
        ctx = ray.init(**LOCAL_RAY)
    _state["local_gcs"] = ctx.address_info["gcs_address"]
    return ray


@contextlib.contextmanager
def fake_gpus_for_ray(count: int = 16):
    """Start Ray's raylets with logical GPUs that are no real device.

    A GPU machine's first test pass hides the GPU (CUDA_VISIBLE_DEVICES=""), and Ray
    refuses logical GPUs next to an empty device list. The raylets start with device ids
    past any real one instead ("100,101,..."): a worker on a GPU bundle gets one of those
    from Ray, which CUDA does not find, so the pass keeps CPU semantics everywhere (the
    real GPU would otherwise be handed to whichever worker got id 0)."""
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES") == ""
    if hidden:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(100 + i) for i in range(count))
    try:
        yield
    finally:
        if hidden:
            os.environ["CUDA_VISIBLE_DEVICES"] = ""


def subprocess_pythonpath(*first: Path | str) -> str:
    """PYTHONPATH for a child Python: `first`, then this process's own entries (a machine
    may provide packages through PYTHONPATH, as the GPU machine provides Ray)."""
    entries = [str(p) for p in first] + os.environ.get("PYTHONPATH", "").split(os.pathsep)
    return os.pathsep.join(e for e in entries if e)


# One GRPO step of the default tiny model, as `rayrl train` is typed (`train_one_step`).
ONE_GRPO_STEP = [
    "train",
    "-c",
    "grpo",
    "trainer.total_training_steps=1",
    "trainer.device=cpu",
    "data.train_batch_size=4",
    "data.max_response_length=4",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "trainer.val_before_train=false",
    "trainer.export_hf=false",
    "trainer.logger=[jsonl]",
]


def train_one_step(out: Path, *overrides: str) -> dict:
    """`rayrl train` (the CLI's entry, in this process, on the session's local Ray) for
    one GRPO step with `overrides`, its run directory `out`; the step's metrics."""
    from rayrl.cli.main import main
    from rayrl.trainer.run_dir import read_metrics

    start_local_ray()
    assert main([*ONE_GRPO_STEP, f"trainer.output_dir={out}", *overrides]) == 0
    [row] = read_metrics(out / "metrics.jsonl")
    return row


_state: dict = {}


@pytest.fixture
def ray_local():
    """A real local Ray cluster, started once and shared by every test that asks."""
    return start_local_ray()


@pytest.fixture
def ray_multinode():
    """A fresh multi-node cluster (several raylets on this host) for one test.

    Yields a factory: `make(nodes=[{"num_cpus": 2, "num_gpus": 2}, ...])` returns the
    `ray.cluster_utils.Cluster`, already connected. Torn down after the test; the
    next `ray_local` user starts the local cluster again.
    """
    import ray
    from ray.cluster_utils import Cluster

    made: list[Cluster] = []

    def make(nodes: list[dict]) -> Cluster:
        if ray.is_initialized():
            ray.shutdown()
        with fake_gpus_for_ray():
            cluster = Cluster(
                initialize_head=True, head_node_args={**nodes[0], "include_dashboard": False}
            )
            for spec in nodes[1:]:
                cluster.add_node(**spec)
            cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        made.append(cluster)
        return cluster

    yield make
    if ray.is_initialized():
        ray.shutdown()
    for cluster in made:
        cluster.shutdown()
    _state.pop("local_gcs", None)


@pytest.fixture(scope="module")
def shared_kv():
    """One KVStore per test module (a single actor start), on the local Ray."""
    import uuid

    from rayrl.cluster.kv import KVStore

    start_local_ray()
    store = KVStore.create(f"test-{uuid.uuid4().hex[:8]}")
    yield store
    store.shutdown()


@pytest.fixture
def kv(ray_local, shared_kv):
    """The module's KVStore; each test keeps to its own keys, namespaces or groups."""
    return shared_kv


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op torch thread for a module: tiny ops on a loaded 2-core machine run
    much faster without thread hand-offs."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def pack_on_cpu(monkeypatch):
    """Packing whenever rows have padding, on a CPU too: tests of the packed path use
    rows with little padding, which the engine would otherwise run padded there
    (`rayrl.train.packing.worth_packing`)."""
    from rayrl.train import packing

    monkeypatch.setattr(packing, "CPU_MIN_PADDING_TO_PACK", 0.0)


def pytest_sessionfinish(session, exitstatus):
    import ray

    if ray.is_initialized():
        ray.shutdown()


def pytest_collection_modifyitems(session, config, items):
    """Multi-node tests last: each one stops the session's local Ray, which the next
    local test would start again (7-16 s on 2 cores). The fault-tolerance module, whose
    module-scoped clean run serves a local and a multi-node test, moves as one block just
    before them."""

    def order(item) -> int:
        if item.module.__name__.endswith("test_fault_tolerance"):
            return 1
        return 2 if "ray_multinode" in getattr(item, "fixturenames", ()) else 0

    items.sort(key=order)  # stable: the rest keep their order
