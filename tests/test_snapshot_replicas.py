"""Step snapshots copied onto a buddy node (`GroupSnapshot.take(replicas=1)`), on a real
two-node cluster: the node that holds a rank's snapshot is removed, and the rank,
replaced on the other node, comes back from the copy there; a snapshot without copies
taken just before is gone with the node."""

from __future__ import annotations

import time
import uuid

import pytest
import ray

from controller_toys import Weighty, reserve
from rayrl.cluster.kv import KVStore
from rayrl.controller import GroupSnapshot, WorkerGroup
from rayrl.controller.recovery import SnapshotLostError, buddy_nodes

pytestmark = pytest.mark.slow


def test_buddies_are_the_next_nodes_in_a_ring_of_the_ranks_nodes():
    assert buddy_nodes(["a", "a", "b"], ["b", "a", "c"], 1) == [["b"], ["b"], ["a"]]
    assert buddy_nodes(["a", "b"], ["a", "b", "c"], 2) == [["b", "c"], ["a", "c"]]
    assert buddy_nodes(["?"], ["a", "b"], 1) == [["a"]]  # a rank of unknown node
    assert buddy_nodes(["a"], ["a"], 1) == [[]]  # one node: nowhere to copy to
    assert buddy_nodes(["a", "b"], ["a", "b"], 0) == [[], []]


@pytest.mark.timeout(600)
def test_a_lost_nodes_snapshot_comes_back_from_its_copy(ray_multinode):
    cluster = ray_multinode([{"num_cpus": 2}, {"num_cpus": 2}])
    head = ray.get_runtime_context().get_node_id()
    run = f"buddy-{uuid.uuid4().hex[:6]}"
    pool = reserve(run, [1, 1], {"CPU": 0.5}, capacity_factor=2.0)
    kv = KVStore.create(run)
    try:
        with WorkerGroup(Weighty, pool.bundles, role="w", run=run, kv=kv, pool=pool) as group:
            group.create(timeout_s=120).init(timeout_s=120)
            nodes = [group.describe(r).node_id for r in range(2)]
            rank = next(r for r in range(2) if nodes[r] != head)
            group.set(7)
            plain = GroupSnapshot.take(group)
            plain.wait_stored(group)
            group.set(8)
            copied = GroupSnapshot.take(group, previous=plain, replicas=1)
            copied.wait_stored(group)  # the copies too
            assert copied.replica_nodes == [[nodes[1]], [nodes[0]]]
            group.set(9)

            victim = next(n for n in cluster.list_all_nodes() if n.node_id == nodes[rank])
            cluster.remove_node(victim, allow_graceful=False)
            deadline = time.monotonic() + 60
            while rank not in group.check_health(timeout_s=5).failed:
                assert time.monotonic() < deadline, "the lost node's rank was not seen dead"
                time.sleep(0.2)
            done = group.replace(rank)
            assert done.new_node == head

            with pytest.raises(SnapshotLostError, match=f"rank {rank} is gone"):
                plain.restore(group)
            assert copied.restore(group) == {rank: head}
            assert group.get() == [8, 8]
    finally:
        kv.shutdown()
        pool.teardown()
