"""Step snapshots in two phases on real Ray (`GroupSnapshot`): the driver waits for the
capture only, the copy into the object store runs on the worker's snapshot thread
beside its next calls, and a rank killed before that copy finished leaves no snapshot
(SnapshotLostError, so the trainer rewinds to a checkpoint) instead of a hang."""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest
import ray

from controller_toys import Stateful, reserve
from rayrl.cluster.kv import KVStore
from rayrl.controller import GroupSnapshot, WorkerGroup
from rayrl.controller.recovery import SnapshotLostError


def _group(run: str, delay: float):
    pool = reserve(run, [1], {"CPU": 0.5})
    kv = KVStore.create(run)
    group = WorkerGroup(Stateful, pool.bundles, role="s", run=run, kv=kv, pool=pool)
    group.create(timeout_s=120).init(timeout_s=120, delay=delay)
    return group, pool, kv


def test_the_copy_into_the_object_store_overlaps_the_next_calls(ray_local):
    run = f"snap-{uuid.uuid4().hex[:6]}"
    group, pool, kv = _group(run, delay=3.0)
    try:
        group.set(7)
        start = time.monotonic()
        snap = GroupSnapshot.take(group)
        group.set(8)  # runs while the snapshot's copy is still going
        assert group.get()[0]["value"] == 8
        elapsed = time.monotonic() - start
        ready, _ = ray.wait(snap.handed, timeout=0)
        assert not ready and elapsed < 2.5, elapsed
        later = GroupSnapshot.take(group, previous=snap)  # waits for the first copy
        assert time.monotonic() - start >= 3.0 and not snap.handed
        snap.restore(group)
        assert group.get()[0]["value"] == 7
        later.restore(group)
        assert group.get()[0]["value"] == 8
    finally:
        group.shutdown()
        pool.teardown()
        kv.shutdown()


def test_a_rank_killed_during_the_copy_leaves_no_snapshot(ray_local):
    run = f"snap-{uuid.uuid4().hex[:6]}"
    group, pool, kv = _group(run, delay=60.0)
    try:
        pid = group.get()[0]["pid"]
        snap = GroupSnapshot.take(group)
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(SnapshotLostError, match="rank 0 was lost while its step snapshot"):
            snap.wait_stored(group, timeout_s=120)
        assert time.monotonic() - start < 30
    finally:
        group.shutdown()
        pool.teardown()
        kv.shutdown()
