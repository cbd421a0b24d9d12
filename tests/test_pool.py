"""ResourcePool: reservation, rank order, spares, split, teardown, exit and signal release."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group

from conftest import fake_gpus_for_ray
from rayrl.cluster import ray_private
from rayrl.cluster.guard import ResourcesBusy, ResourcesUnsatisfiable, assess
from rayrl.cluster.inspect import snapshot
from rayrl.cluster.pool import PoolSpec, ResourcePool, reserve_pools

GPU = {"GPU": 1.0, "CPU": 1.0}


def _live_groups(prefix: str) -> list[str]:
    return [g.name for g in snapshot().groups if g.name.startswith(prefix)]


@ray.remote(num_cpus=0)
def _where() -> str:
    return ray.get_runtime_context().get_node_id()


# -- spec ----------------------------------------------------------------------------


def test_spec_validation_and_spare_count():
    assert PoolSpec("p", [8, 8], GPU).world_size == 16
    assert PoolSpec("p", [10], GPU, capacity_factor=1.1).num_spares == 1  # not 2 from float noise
    assert PoolSpec("p", [8], GPU, capacity_factor=1.25).num_spares == 2
    assert PoolSpec("p", [3], GPU, capacity_factor=1.5).num_spares == 2  # ceil(1.5)
    assert PoolSpec("p", [2], {"CPU": 1}, loader_workers=3).worker_cpus == 4
    for bad in (
        dict(per_node=[]),
        dict(per_node=[0]),
        dict(bundle={}),
        dict(strategy="RANDOM"),
        dict(capacity_factor=0.5),
        dict(lifetime="forever"),
    ):
        kwargs = dict(name="p", per_node=[1], bundle=GPU) | bad
        with pytest.raises(ValueError, match="PoolSpec 'p'"):
            PoolSpec(**kwargs)


# -- single node (ray_local: 8 CPUs, 4 GPUs) -----------------------------------------


def test_bootstrap_spares_split_and_idempotent_teardown(ray_local):
    pool = ResourcePool(PoolSpec("actor", [3], GPU, capacity_factor=1.3), run="t1")
    bundles = pool.bootstrap(timeout_s=20)
    assert pool.bootstrap() == bundles  # already reserved: same bundles
    assert len(bundles) == 3 and len(pool.spares) == 1
    assert [b.index for b in bundles] == [0, 1, 2]
    assert all(b.pool == "rayrl/t1/actor" and not b.spare for b in bundles)
    assert sorted(_live_groups("rayrl/t1/actor")) == ["rayrl/t1/actor/0", "rayrl/t1/actor/spares0"]
    node = bundles[0].node_id
    task = _where.options(scheduling_strategy=bundles[1].scheduling_strategy())
    assert ray.get(task.remote(), timeout=60) == node

    first, second = pool.split([1, 2])
    assert first == bundles[:1] and second == bundles[1:]
    with pytest.raises(ValueError, match="add up to"):
        pool.split([2, 2])

    spare = pool.take_spare(avoid_node=node)  # the only node: falls back to it
    assert spare is not None and spare.spare and spare.node_id == node
    assert pool.take_spare() is None and pool.spares == []

    pool.teardown()
    pool.teardown()
    assert pool.bundles == [] and not pool.reserved
    deadline = time.monotonic() + 10
    while _live_groups("rayrl/t1/") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _live_groups("rayrl/t1/") == []
    with pytest.raises(RuntimeError, match="bootstrap"):
        pool.split([3])


def test_other_strategies(ray_local):
    spread = ResourcePool(PoolSpec("spread", [1, 2], GPU, strategy="SPREAD"), run="t2")
    assert len(spread.bootstrap(timeout_s=20)) == 3
    assert _live_groups("rayrl/t2/") == ["rayrl/t2/spread/0"]
    spread.teardown()
    # STRICT_SPREAD needs one node per bundle; ray_local has one node.
    strict = ResourcePool(PoolSpec("strict", [2], GPU, strategy="STRICT_SPREAD"), run="t2")
    with pytest.raises(ResourcesUnsatisfiable, match="2 distinct nodes"):
        strict.bootstrap(timeout_s=20)
    assert not strict.reserved


def test_placement_timeout_removes_groups_and_raises(ray_local, monkeypatch):
    """Resources taken between the fit check and the reservation: bounded wait, clean error."""
    from rayrl.cluster import pool as pool_module

    spec = PoolSpec("late", [1], GPU)
    cluster = snapshot()
    stale_view = pool_module.assess([spec], cluster)  # taken while everything is free
    monkeypatch.setattr(pool_module, "check", lambda pools, timeout_s: stale_view)
    holder = placement_group([{"GPU": 4.0}], name="rayrl/other/race")
    assert holder.wait(10)
    try:
        start = time.monotonic()
        with pytest.raises(ResourcesBusy, match="not placed in time") as err:
            ResourcePool(spec, run="race").bootstrap(timeout_s=1.0)
        assert time.monotonic() - start < 8
        assert "rayrl/other/race" in err.value.table
        deadline = time.monotonic() + 10
        while _live_groups("rayrl/race/") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _live_groups("rayrl/race/") == []
    finally:
        remove_placement_group(holder)


def test_a_runs_pools_are_checked_together_and_none_is_held_alone(ray_local):
    holder = placement_group([{"GPU": 3.0}], name="rayrl/other/three")
    assert holder.wait(10)
    try:
        fits = PoolSpec("actor", [1], GPU)  # 1 of the 4 GPUs: fits alone
        blocked = PoolSpec("critic", [1], GPU)  # a second GPU: held by the holder
        with pytest.raises(ResourcesBusy) as err:
            reserve_pools([fits, blocked], run="together", timeout_s=1.0)
        assert "'actor', 'critic'" in str(err.value)
        ever = [g["name"] for g in ray_private.placement_groups()]  # removed ones included
        assert not [n for n in ever if n.startswith("rayrl/together/")], ever
    finally:
        remove_placement_group(holder)
    pools = reserve_pools([fits, blocked], run="together", timeout_s=20)
    assert [len(p.bundles) for p in pools] == [1, 1]
    for pool in pools:
        pool.teardown()


DRIVER = """
import atexit, logging, os, signal, sys, time
import ray
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from rayrl.cluster.inspect import snapshot
from rayrl.cluster.pool import PoolSpec, ResourcePool
ray.init(address=sys.argv[1], log_to_driver=False)
prefix = f"rayrl/{sys.argv[2]}/"

def gone() -> bool:  # while this driver lives, Ray itself would not release its groups
    deadline = time.monotonic() + 10
    while [g for g in snapshot().groups if g.name.startswith(prefix)]:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True

def on_term(signum, frame):  # runs after the pool's handler, before the process ends
    print("GONE BEFORE EXIT", gone(), flush=True)
    os._exit(143)

# Registered before the pool's own hooks: atexit runs them last-in first-out.
atexit.register(lambda: print("GONE BEFORE EXIT", gone(), flush=True))
signal.signal(signal.SIGTERM, on_term)
pool = ResourcePool(PoolSpec("gen", [1], {"GPU": 1, "CPU": 1}), run=sys.argv[2])
pool.bootstrap(timeout_s=30)
print("READY", flush=True)
if sys.argv[3] == "wait":
    time.sleep(60)
"""


@pytest.mark.parametrize("how", ["sigterm", "exit"])
def test_driver_exit_or_sigterm_releases_pool(ray_local, how):
    gcs = ray.get_runtime_context().gcs_address
    run = f"sig-{how}"
    mode = "wait" if how == "sigterm" else "exit"
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER, gcs, run, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "READY"
        if how == "sigterm":
            os.kill(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    reason = "signal SIGTERM" if how == "sigterm" else "interpreter exit"
    assert f"releasing pool rayrl/{run}/gen ({reason})" in err, err
    assert f"pool rayrl/{run}/gen released 1 placement groups" in err, err
    # Released by the driver itself, before it ended (Ray frees a dead job's groups anyway).
    assert "GONE BEFORE EXIT True" in out, out + err
    if how == "sigterm":
        assert proc.returncode != 0  # the previous handler still ended the process


# -- two nodes (one cluster shared by the tests below; they run last) ---------------


@pytest.fixture(scope="module")
def two_nodes():
    """Two raylets with 4 CPUs and 4 GPUs each; this driver connected to them."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    node = {"num_cpus": 4, "num_gpus": 4}
    with fake_gpus_for_ray():
        cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
        cluster.add_node(**node)
        cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    yield sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
    ray.shutdown()
    cluster.shutdown()


@pytest.mark.slow
def test_impossible_request_fails_fast_with_table(two_nodes):
    node_ids = two_nodes
    start = time.monotonic()
    with pytest.raises(ResourcesUnsatisfiable) as err:
        ResourcePool(PoolSpec("rollout", [8], GPU), run="big").bootstrap(timeout_s=60)
    assert time.monotonic() - start < 10
    text = str(err.value)
    assert "can never fit" in text and "the most any node has is GPU 4" in text
    for needle in ("rollout", "GPU 1, CPU 1", "STRICT_PACK", "[8]", "GPU", "4 / 4"):
        assert needle in err.value.table, err.value.table
    for node_id in node_ids:
        assert node_id[:8] in err.value.table
    # The same GPUs split per node fit.
    assert assess([PoolSpec("rollout", [4, 4], GPU)], snapshot()).status == "fits"


@pytest.mark.slow
def test_ranks_stable_across_teardown_and_spares_avoid_node(two_nodes):
    nodes = two_nodes
    spec = PoolSpec("actor", [3, 1], GPU, capacity_factor=1.5)
    pool = ResourcePool(spec, run="ranks")
    first = [b.node_id for b in pool.bootstrap(timeout_s=30)]
    assert first == [nodes[0], nodes[0], nodes[0], nodes[1]]
    assert len(pool.spares) == 2
    pool.teardown()
    again = [b.node_id for b in pool.bootstrap(timeout_s=30)]
    assert again == first  # same rank -> node map after a new reservation
    placed = ray.get(
        [_where.options(scheduling_strategy=b.scheduling_strategy()).remote() for b in pool.bundles]
    )
    assert placed == first
    pool.teardown()

    # 6 active GPUs leave one free GPU per node, so the two spares sit on different nodes.
    wide = ResourcePool(PoolSpec("gen", [3, 3], {"GPU": 1.0}, capacity_factor=1.3), run="ranks")
    wide.bootstrap(timeout_s=30)
    assert sorted(b.node_id for b in wide.spares) == nodes
    for avoid, other in ((nodes[0], nodes[1]), (nodes[1], nodes[0])):
        spare = wide.take_spare(avoid_node=avoid)
        assert spare is not None and spare.spare and spare.node_id == other
    assert wide.take_spare() is None
    wide.teardown()


@pytest.mark.slow
def test_an_aligned_pool_is_reserved_on_its_partners_nodes(two_nodes):
    """`align_with`: the helpers' per-node group i lands on the node of the workers' group
    i, and actors started in those bundles run there."""
    nodes = two_nodes
    workers = PoolSpec("workers", [3, 1], GPU)
    helpers = PoolSpec("helpers", [1, 2], {"CPU": 1.0}, align_with="workers")
    pools = reserve_pools([workers, helpers], run="aligned", timeout_s=30)
    try:
        assert [b.node_id for b in pools[0].bundles] == [nodes[0]] * 3 + [nodes[1]]
        placed = [b.node_id for b in pools[1].bundles]
        assert placed == [nodes[0], nodes[1], nodes[1]]
        where = [
            _where.options(scheduling_strategy=b.scheduling_strategy()).remote()
            for b in pools[1].bundles
        ]
        assert ray.get(where) == placed
    finally:
        for pool in pools:
            pool.teardown()
