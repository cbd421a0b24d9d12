"""Step snapshots in two phases on real Ray (`GroupSnapshot`): the driver waits for the
capture only, the copy into the object store runs on the worker's snapshot thread
beside its next calls, and a rank killed before that copy finished leaves no snapshot
(SnapshotLostError) instead of a hang; step replay then goes back to the boundary before
it, which it kept in memory until the newer one was stored."""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest
import ray

from controller_toys import Filling, Stateful, Tally, reserve
from rayrl.cluster.kv import KVStore
from rayrl.controller import GroupSnapshot, WorkerGroup
from rayrl.controller.recovery import SnapshotLostError
from rayrl.trainer.replay import ReplayPolicy, Rewound, StepReplay
from rayrl.trainer.stage_calls import StageCalls


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


def test_a_snapshot_filled_behind_its_call_is_published_whole(ray_local):
    """A worker's state still being filled when `snapshot_state` returns (a `Pending`,
    as a GPU's copies): the snapshot call does not wait for it, and what is stored and
    restored is the state once complete."""
    run = f"snap-{uuid.uuid4().hex[:6]}"
    pool = reserve(run, [1], {"CPU": 0.5})
    kv = KVStore.create(run)
    group = WorkerGroup(Filling, pool.bundles, role="f", run=run, kv=kv, pool=pool)
    try:
        group.create(timeout_s=120).init(timeout_s=120, delay=2.0)
        group.set(7)
        start = time.monotonic()
        snap = GroupSnapshot.take(group)
        assert time.monotonic() - start < 1.5  # the call returned before the fill
        group.set(8)
        snap.restore(group)
        assert group.get()[0]["value"] == 7
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


def test_a_rank_lost_before_its_boundary_is_stored_goes_back_one_boundary_more(ray_local):
    """Step 1's boundary snapshot is still on its way into the object store when the rank
    dies in step 2: the run goes back to step 1's start (held in memory until then) for
    the groups and the driver, not to a checkpoint; a boundary stored whole lets the one
    before it go."""
    run = f"snap-{uuid.uuid4().hex[:6]}"
    group, pool, kv = _group(run, delay=0.0)
    calls, tally, backs, rewinds = StageCalls(), Tally(), [], []
    policy = ReplayPolicy(max_restarts=2, snapshots=True, init_timeout_s=120)
    replay = StepReplay([group], [group], calls, policy, rewinds.append, on_back=backs.append)
    parts = {"tally": tally}
    try:
        group.set(7)
        replay.start()
        [first] = replay.snapshots.values()
        first.wait_stored(group)

        def step_one():
            tally.count += 1
            calls.run("set", group.set, 8, mutates=True)
            group.slow_down(60.0)  # its boundary's snapshot takes a minute to be stored
            return {}, ["p0"]

        replay.run_step(0, step_one, parts)
        assert replay.previous is not None and replay.previous.step == 0
        pid = group.get()[0]["pid"]

        def step_two():
            tally.count += 1
            os.kill(pid, signal.SIGKILL)
            calls.run("set", group.set, 9, mutates=True)
            return {}, ["p1"]

        with pytest.raises(Rewound) as info:
            replay.run_step(1, step_two, parts)
        assert info.value.step == 0 and backs == [0] and not rewinds
        assert group.get()[0]["value"] == 7 and group.get()[0]["pid"] != pid
        assert tally.count == 0 and replay.ledger == []
        assert replay.recoveries[-1]["back_to"] == 0 and replay.previous is None

        # the run goes on from there; a boundary stored whole lets the one before it go
        group.slow_down(0.0)  # (and the replaced rank starts without the delay)
        replay.run_step(
            0, lambda: (calls.run("set", group.set, 8, mutates=True) and {}, ["p0"]), parts
        )
        replay.run_step(1, lambda: ({}, ["p1"]), parts)
        deadline = time.monotonic() + 90
        while replay.previous is not None:
            assert time.monotonic() < deadline, "the boundary before was never let go"
            time.sleep(0.2)
        assert replay.ledger == [(0, ["p0"]), (1, ["p1"])] and group.get()[0]["value"] == 8
    finally:
        group.shutdown()
        pool.teardown()
        kv.shutdown()
