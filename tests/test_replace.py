"""Health and replacement on real Ray: `kill -9` of a worker is detected, the worker is
replaced in its bundle and the gloo process group re-formed on all ranks; on two nodes,
a 2 x 2 world forms gloo through KV discovery, then losing a whole node moves its ranks
to spare bundles on the other node, with a topology warning, and the group re-forms."""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest
import ray

from controller_toys import Dist, reserve
from rayrl.cluster import ray_private
from rayrl.cluster.kv import KVStore
from rayrl.controller import (
    HealthMonitor,
    TopologyChangedWarning,
    WorkerCallError,
    WorkerGroup,
)


def wait_for_failure(group: WorkerGroup, timeout_s: float = 60.0, ranks=None):
    """Health-check until some rank (or all of `ranks`) is reported failed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        report = group.check_health(timeout_s=5)
        if not report.ok and (ranks is None or set(ranks) <= set(report.failed)):
            return report
        time.sleep(0.2)
    raise AssertionError(f"no failure detected within {timeout_s} s")


def test_kill_9_is_detected_replaced_and_the_group_reformed(ray_local):
    run = f"kill-{uuid.uuid4().hex[:6]}"
    pool = reserve(run, [3], {"CPU": 0.5})
    kv = KVStore.create(run)
    try:
        with WorkerGroup(Dist, pool.bundles, role="dist", run=run, kv=kv, pool=pool) as group:
            group.create(timeout_s=120).init(timeout_s=120, backend="gloo", dist_timeout_s=180)
            assert group.all_reduce() == [6.0] * 3
            before = group.whoami()
            with HealthMonitor(group, interval_s=0.3, timeout_s=5) as monitor:
                time.sleep(0.5)
                assert monitor.last is not None and monitor.last.ok
                os.kill(before[1]["pid"], signal.SIGKILL)
                deadline = time.monotonic() + 60
                while not monitor.failed and time.monotonic() < deadline:
                    time.sleep(0.1)  # the periodic heartbeat notices the dead rank
            assert monitor.failed == {1} and 1 in monitor.last.dead
            assert 1 in group.dead
            with pytest.raises(WorkerCallError) as info:
                group.whoami()
            assert info.value.dead and info.value.rank == 1
            assert "group.replace(1)" in str(info.value)

            done = group.replace(1)
            assert not done.moved and not done.spare_used  # node alive: same bundle
            assert done.old_pid == before[1]["pid"] != done.new_pid
            after = group.whoami()
            assert [a["pid"] for a in after][::2] == [b["pid"] for b in before][::2]
            assert [a["generation"] for a in after] == [1, 1, 1]
            assert group.all_reduce() == [6.0] * 3
            assert group.check_health().ok and not group.dead
            # Only the current generation's discovery keys are kept.
            keys = kv.list(group.scope + "/", namespace="discovery")
            assert f"{group.scope}/gen1/master" in keys
            assert all(k.startswith(f"{group.scope}/gen1/") for k in keys), keys
        with pytest.raises(WorkerCallError, match="has no worker"):
            group.whoami()  # after shutdown (the with block) a call says so
        assert kv.list(group.scope + "/", namespace="discovery") == []  # shutdown deletes them
    finally:
        kv.shutdown()
        pool.teardown()


def node_of_actor(handle) -> str:
    """The node id an actor runs on, from the GCS actor table."""
    return ray_private.actor_row(handle)["node_id"]


@pytest.mark.slow
def test_2x2_on_two_nodes_all_reduces_then_moves_a_lost_nodes_ranks_to_spares(ray_multinode):
    # Head without CPUs; two nodes of 2 CPUs: 2 active + 2 spare bundles of 0.5 CPU each.
    cluster = ray_multinode([{"num_cpus": 0}, {"num_cpus": 2}, {"num_cpus": 2}])
    run = f"node-{uuid.uuid4().hex[:6]}"
    pool = reserve(run, [2, 2], {"CPU": 0.5}, capacity_factor=2.0)
    kv = KVStore.create(run)
    try:
        with WorkerGroup(Dist, pool.bundles, role="dist", run=run, kv=kv, pool=pool) as group:
            group.create(timeout_s=120).init(timeout_s=120, backend="gloo", dist_timeout_s=180)
            infos = group.whoami()
            nodes = [i["node_id"] for i in infos]
            assert nodes[0] == nodes[1] != nodes[2] == nodes[3]
            assert [i["local_rank"] for i in infos] == [0, 1, 0, 1]
            assert group.all_reduce() == [10.0] * 4  # 1 + 2 + 3 + 4, through KV discovery
            assert f"{group.scope}/gen0/master" in kv.list(group.scope, namespace="discovery")

            # The KV server is pinned to the driver's node (the head), so losing a
            # worker node never takes discovery with it.
            assert node_of_actor(kv._actor) == ray.get_runtime_context().get_node_id()
            lost, kept = nodes[2], nodes[0]
            gone = [r for r in range(4) if nodes[r] == lost]
            victim = next(n for n in cluster.list_all_nodes() if n.node_id == lost)
            cluster.remove_node(victim, allow_graceful=False)

            report = wait_for_failure(group, ranks=gone)
            assert report.failed == gone
            with pytest.warns(TopologyChangedWarning) as caught:
                done = group.replace(gone)
            messages = {str(w.message) for w in caught}
            for r in gone:
                assert any(f"rank {r} moved from node {lost} to node {kept}" in m for m in messages)
            assert all(d.moved and d.spare_used for d in done)
            assert [(d.old_node, d.new_node) for d in done] == [(lost, kept)] * 2
            after = group.whoami()
            assert [a["node_id"] for a in after] == [kept] * 4
            assert sorted(a["local_rank"] for a in after) == [0, 1, 2, 3]  # one node now
            assert [a["generation"] for a in after] == [1] * 4
            assert group.all_reduce() == [10.0] * 4
            assert all(b.node_id != kept for b in pool.spares)  # both spares there were used
            # the lost node's groups were removed: none is left for Ray to place again
            # (while one is, Ray's GCS and dashboard agent use about a core between them)
            states = {
                t["name"]: t["state"]
                for t in ray.util.placement_group_table().values()
                if t["name"].startswith(pool.name + "/")
            }
            assert not {"RESCHEDULING", "PENDING"} & set(states.values()), states
    finally:
        kv.shutdown()
        pool.teardown()
