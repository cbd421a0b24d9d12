"""A rank killed inside a gloo collective: every other rank's call fails within
seconds (each rank that sees the loss leaves its process groups, so the ranks waiting
on it stop waiting too), the survivors stay alive, and the group re-forms without
replacing them (`rayrl.controller.collective_failure`). Also when the collectives run
on a device mesh's sub-groups under FSDP2, whose states and meshes keep their own
references to the groups (`rayrl.train.group_release`)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid

import pytest
import ray

from controller_toys import Dist, ShardedDist, reserve
from rayrl.cluster.kv import KVStore
from rayrl.controller import WorkerGroup
from rayrl.controller.collective_failure import is_gloo_peer_lost


def test_a_rank_killed_mid_all_reduce_fails_every_rank_at_once_and_only_it_is_replaced(
    ray_local,
):
    with _gloo_group(Dist) as group:
        before = group.whoami()
        future = group.all_reduce_for.remote(60.0)
        time.sleep(2.0)  # every rank is in its all-reduce loop
        took = _killed_mid_call_fails_every_rank(future, 2, before[2]["pid"])
        assert took < 20, took
        done = group.replace(2)  # the survivors re-form the group with the new rank
        _survivors_kept(before, group.whoami(), 2)
        assert done.new_pid != before[2]["pid"]
        assert group.all_reduce() == [10.0] * 4


@contextlib.contextmanager
def _gloo_group(worker_cls):
    """Four ranks of `worker_cls` on the local Ray, their gloo group formed."""
    run = f"coll-{uuid.uuid4().hex[:6]}"
    pool = reserve(run, [4], {"CPU": 0.5})
    kv = KVStore.create(run)
    try:
        with WorkerGroup(worker_cls, pool.bundles, role="dist", run=run, kv=kv, pool=pool) as g:
            g.create(timeout_s=120).init(timeout_s=120, backend="gloo", dist_timeout_s=600)
            yield g
    finally:
        kv.shutdown()
        pool.teardown()


def _survivors_kept(before: list[dict], after: list[dict], victim: int) -> None:
    """Every rank but `victim` kept its process through the replacement."""
    kept = [a["pid"] for i, a in enumerate(after) if i != victim]
    assert kept == [b["pid"] for i, b in enumerate(before) if i != victim]


def _killed_mid_call_fails_every_rank(future, victim: int, pid: int) -> float:
    """Kill rank `victim` (process `pid`) while `future` runs; every other rank's call
    must fail with gloo's error within 30 s. Returns the seconds they took."""
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    alive = [ref for rank, ref in enumerate(future.refs) if rank != victim]
    done, waiting = ray.wait(alive, num_returns=len(alive), timeout=30)
    took = time.monotonic() - killed_at
    assert not waiting, f"ranks still blocked {took:.0f} s after the kill"
    for ref in done:
        try:
            ray.get(ref)
            raise AssertionError(f"a rank finished its call without rank {victim}")
        except ray.exceptions.RayTaskError as err:
            assert "gloo" in str(err)
    return took


@pytest.mark.slow
def test_a_rank_killed_in_fsdp_collectives_on_mesh_subgroups_fails_every_rank_at_once(
    ray_local,
):
    with _gloo_group(ShardedDist) as g:
        g.build(2)  # 2 x 2: FSDP shards over pairs, replicates across them
        before = g.whoami()
        future = g.train_for.remote(120.0)
        time.sleep(3.0)  # every rank is in its training loop
        took = _killed_mid_call_fails_every_rank(future, 2, before[2]["pid"])
        assert took < 20, took
        g.replace(2)
        _survivors_kept(before, g.whoami(), 2)
        assert g.all_reduce() == [10.0] * 4


def test_only_gloos_lost_peer_errors_count():
    lost = RuntimeError(
        "[third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [1.2.3.4]:5"
    )
    assert is_gloo_peer_lost(lost)
    assert not is_gloo_peer_lost(RuntimeError("CUDA out of memory"))
    assert not is_gloo_peer_lost(ValueError("gloo Connection closed by peer"))
