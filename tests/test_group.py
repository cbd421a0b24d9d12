"""WorkerGroup phases on real Ray: create (bounded wait, errors naming the bundle), and
init with a per-worker timeout and retries of the failing worker only.

The 2 x 2 world on two nodes (gloo through KV discovery) is in test_replace.py, where
the same cluster then loses a node: one multi-node cluster instead of two."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
import ray

from controller_toys import BundleHog, Dist, Flaky, LateRankZero, SlowStart, reserve
from rayrl.cluster.kv import KVStore
from rayrl.controller import WorkerCreateError, WorkerGroup, WorkerInitError


@pytest.fixture
def run_pool(ray_local):
    """A fresh run name and a 2-bundle pool of 0.5 CPU each; torn down after."""
    run = f"grp-{uuid.uuid4().hex[:6]}"
    pool = reserve(run, [2], {"CPU": 0.5})
    yield run, pool
    pool.teardown()


def test_init_failing_once_succeeds_on_retry_of_that_worker_only(run_pool, tmp_path):
    run, pool = run_pool
    marker = str(tmp_path / "count")
    with WorkerGroup(Flaky, pool.bundles, role="flaky", run=run) as group:
        group.create(timeout_s=60)
        before = [i["pid"] for i in group.whoami()]
        group.init(timeout_s=60, retries=2, marker=marker, bad_rank=1, failures=1)
        after = [i["pid"] for i in group.whoami()]
        assert Path(marker).read_text() == "2"  # failed once, passed on the retry
        assert after[0] == before[0], "the healthy worker must not be restarted"
        assert after[1] != before[1], "the failing worker is recreated in its bundle"


def test_init_always_failing_names_phase_rank_and_log(run_pool, tmp_path):
    run, pool = run_pool
    marker = str(tmp_path / "count")
    with WorkerGroup(Flaky, pool.bundles, role="flaky", run=run) as group:
        group.create(timeout_s=60)
        with pytest.raises(WorkerInitError) as info:
            group.init(timeout_s=60, retries=1, marker=marker, bad_rank=1, failures=99)
    err = info.value
    assert (err.phase, err.stage, err.role, err.rank) == ("init", "init_worker", "flaky", 1)
    assert err.log_file and os.path.exists(err.log_file)
    assert err.node_id == ray.get_runtime_context().get_node_id()
    text = str(err)
    assert "init failure 2 of rank 1" in text  # the last attempt's remote traceback
    assert "tried 2 times" in text and err.log_file in text
    assert Path(marker).read_text() == "2"


def test_create_timeout_of_a_hanging_constructor_names_pid_log_and_bundle(run_pool):
    run, pool = run_pool
    group = WorkerGroup(SlowStart, pool.bundles[:1], role="slow", run=run, kwargs={"seconds": 60})
    with pytest.raises(WorkerCreateError) as info:
        group.create(timeout_s=8)  # the process starts in about a second; its constructor hangs
    err = info.value
    text = str(err)
    assert (err.phase, err.stage, err.role, err.rank) == ("create", "SlowStart.__init__", "slow", 0)
    assert "bundle 0 of pool" in text and pool.bundles[0].node_id in text
    assert err.pid is not None, text
    assert "constructor did not return within 8 s" in text
    assert os.path.exists(err.log_file) and err.log_file in text
    assert group.actors == [None], "a failed create leaves no actors behind"


def test_create_timeout_when_ray_cannot_start_the_actor(run_pool):
    run, pool = run_pool
    bundle = pool.bundles[0]
    hog = BundleHog.options(scheduling_strategy=bundle.scheduling_strategy()).remote()
    ray.get(hog.ready.remote(), timeout=60)  # the bundle's CPU is taken
    try:
        group = WorkerGroup(Dist, [bundle], role="starved", run=run)
        with pytest.raises(WorkerCreateError) as info:
            group.create(timeout_s=2)
        err = info.value
        assert err.pid is None and "Ray did not start the actor within 2 s" in str(err), err
        assert "held by another actor" in str(err) and group.actors == [None]
    finally:
        ray.kill(hog)


def test_worker_knows_its_place(run_pool):
    run, pool = run_pool
    with WorkerGroup(Dist, pool.bundles, role="d", run=run) as group:
        infos = group.create(timeout_s=60).whoami()
        assert [i["rank"] for i in infos] == [0, 1]
        assert [i["local_rank"] for i in infos] == [0, 1]
        assert group.infos[1]["log_file"].endswith(f"-{infos[1]['pid']}.err")
        assert os.path.exists(group.infos[1]["log_file"])


def test_a_rank_whose_bundle_has_no_gpu_sees_none(ray_local):
    """Ray leaves a worker without GPUs the node's devices; rayrl hides them, so a CPU
    role (or a CPU run) on a GPU machine never uses a GPU nobody reserved for it."""
    run = f"grp-{uuid.uuid4().hex[:6]}"
    cpu_pool = reserve(run, [1], {"CPU": 0.5})
    gpu_pool = reserve(f"{run}-g", [1], {"CPU": 0.5, "GPU": 1})
    try:
        bundles = cpu_pool.bundles + gpu_pool.bundles
        with WorkerGroup(Dist, bundles, role="d", run=run) as group:
            seen = group.create(timeout_s=60).visible_devices()
        assert seen[0] == ""  # hidden (Ray would leave it unset)
        assert seen[1] not in (None, "")  # the id Ray assigned to the GPU bundle
    finally:
        cpu_pool.teardown()
        gpu_pool.teardown()


def test_group_recreated_under_same_run_and_role_never_reads_the_old_master(ray_local):
    """Two groups named alike: the second's ranks must wait for its own rank 0, not join
    the first's process group through its master key (generations both start at 0)."""
    run = f"scope-{uuid.uuid4().hex[:6]}"
    pool = reserve(run, [3], {"CPU": 0.25})
    kv = KVStore.create(run)
    first_bundles, second_bundles = pool.split([1, 2])
    first = WorkerGroup(Dist, first_bundles, role="d", run=run, kv=kv)
    second = WorkerGroup(
        LateRankZero, second_bundles, role="d", run=run, kv=kv, kwargs={"delay_s": 2.0}
    )
    try:
        first.create(timeout_s=120).init(timeout_s=120, backend="gloo", dist_timeout_s=20)
        second.create(timeout_s=120).init(timeout_s=120, backend="gloo", dist_timeout_s=20)
        assert first.name == second.name and first.scope != second.scope
        assert second.all_reduce() == [3.0, 3.0] and first.all_reduce() == [1.0]
    finally:
        first.shutdown()
        second.shutdown()
        kv.shutdown()
        pool.teardown()
