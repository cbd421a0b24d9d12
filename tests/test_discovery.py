"""Service discovery through the KVStore: rendezvous, and torch.distributed (gloo) formed
from it on a real two-node Ray cluster, then re-formed as a new generation."""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid

import pytest
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rayrl.cluster.discovery import (
    DISCOVERY_NAMESPACE,
    DiscoveryError,
    RendezvousTimeoutError,
    arrival_key,
    free_port,
    init_process_group,
    master_key,
    node_ip,
    rendezvous,
)
from rayrl.cluster.interface import interface_holding
from rayrl.cluster.kv import KVStore, KVTimeoutError


@ray.remote(num_cpus=1)
class DistRank:
    """A toy rank: joins a process group through KV discovery and all-reduces."""

    def join(self, kv: KVStore, group: str, rank: int, world: int, generation: int) -> str:
        init_process_group(kv, group, rank, world, generation=generation, timeout=60)
        assert "MASTER_ADDR" not in os.environ and "MASTER_PORT" not in os.environ
        return ray.get_runtime_context().get_node_id()

    def bound_to(self) -> tuple[str, str, str]:
        """(GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME, this node's Ray address)."""
        env = os.environ
        return env["GLOO_SOCKET_IFNAME"], env["NCCL_SOCKET_IFNAME"], node_ip()

    def all_reduce(self) -> tuple[float, int, int]:
        import torch
        import torch.distributed as dist

        rank = dist.get_rank()
        value = torch.tensor([float(rank + 1)])
        dist.all_reduce(value)
        return value.item(), rank, dist.get_world_size()


@pytest.fixture
def g() -> str:
    """A group name of this test's own."""
    return f"grp-{uuid.uuid4().hex[:8]}"


def test_free_port_and_node_ip(ray_local):
    port = free_port()
    assert 0 < port < 65536
    with socket.socket() as sock:
        sock.bind(("", port))  # still free
    assert node_ip() == ray.util.get_node_ip_address()


def test_rendezvous_rank0_publishes_others_wait(kv, g):
    got: list = []
    threads = [
        threading.Thread(target=lambda r=r: got.append(rendezvous(kv, g, r, 3, timeout=30)))
        for r in (1, 2)
    ]
    for thread in threads:
        thread.start()
    master = rendezvous(kv, g, 0, 3)
    for thread in threads:
        thread.join(timeout=30)
    assert got == [master, master]
    assert kv.get(master_key(g), namespace=DISCOVERY_NAMESPACE) == master
    assert kv.info(master_key(g), namespace=DISCOVERY_NAMESPACE)["writer"]["label"] == f"{g} rank 0"


def test_rendezvous_without_rank0_times_out_naming_the_key(kv, g):
    rendezvous(kv, g, 0, 1, generation=0)
    with pytest.raises(KVTimeoutError) as info:
        rendezvous(kv, g, 1, 2, generation=1, timeout=0.2)
    msg = str(info.value)
    assert f"'{g}/gen1/master'" in msg and f"namespace '{DISCOVERY_NAMESPACE}'" in msg
    assert f"'{g}/gen0/master'" in msg  # the earlier generation is among the nearest keys
    assert f"'{g}/gen1/ranks/1'" in msg and f"'{g} rank 1'" in msg  # own arrival: last write


def test_rank0_names_the_ranks_that_never_arrived(kv, g):
    errors: list = []

    def rank1():
        try:
            rendezvous(kv, g, 1, 4, timeout=1)
        except KVTimeoutError as err:
            errors.append(err)

    thread = threading.Thread(target=rank1)
    thread.start()
    deadline = time.monotonic() + 10
    while kv.get(arrival_key(g, 0, 1), namespace=DISCOVERY_NAMESPACE) is None:
        assert time.monotonic() < deadline, "rank 1 never announced itself"
        time.sleep(0.01)
    with pytest.raises(RendezvousTimeoutError) as info:
        rendezvous(kv, g, 0, 4, timeout=0.3)
    thread.join(timeout=30)
    assert isinstance(info.value, TimeoutError)
    assert "ranks [2, 3] of world size 4 never arrived (arrived: [0, 1])" in str(info.value)
    assert len(errors) == 1 and errors[0].key == f"{g}/gen0/master"


def test_bad_rank_is_refused(kv, g):
    with pytest.raises(DiscoveryError, match=r"rank 2 is not in \[0, world_size=2\)"):
        rendezvous(kv, g, 2, 2)


def test_same_generation_twice_warns(kv, g, caplog):
    rendezvous(kv, g, 0, 1)
    with caplog.at_level("WARNING", logger="rayrl.cluster.discovery"):
        rendezvous(kv, g, 0, 1)
    assert "already had a master" in caplog.text and "new generation" in caplog.text


@pytest.mark.slow
def test_two_nodes_form_gloo_group_and_reform(ray_multinode):
    ray_multinode([{"num_cpus": 2}, {"num_cpus": 2}])
    nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
    assert len(nodes) == 2
    kv = KVStore.create("disc-multinode")
    ranks = [
        DistRank.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=nodes[i // 2], soft=False)
        ).remote()
        for i in range(4)
    ]
    placed = ray.get([a.join.remote(kv, "trainer", i, 4, 0) for i, a in enumerate(ranks)])
    assert placed == [nodes[0], nodes[0], nodes[1], nodes[1]]  # 2 x 2 over two nodes
    # gloo and NCCL listen on the interface holding the node's Ray address
    for gloo, nccl, address in ray.get([a.bound_to.remote() for a in ranks]):
        assert gloo == nccl == interface_holding(address), (gloo, nccl, address)
    assert ray.get([a.all_reduce.remote() for a in ranks]) == [(10.0, i, 4) for i in range(4)]

    # Re-form as generation 1 with the ranks reassigned (rank 0 moves to the other node).
    order = [3, 2, 1, 0]
    ray.get([a.join.remote(kv, "trainer", order[i], 4, 1) for i, a in enumerate(ranks)])
    results = ray.get([a.all_reduce.remote() for a in ranks])
    assert results == [(10.0, order[i], 4) for i in range(4)]
    keys = kv.list("trainer/", namespace=DISCOVERY_NAMESPACE)
    assert [k for k in keys if k.endswith("/master")] == [master_key("trainer", g) for g in (0, 1)]
    assert kv.list("trainer/gen1/ranks/", namespace=DISCOVERY_NAMESPACE) == [
        arrival_key("trainer", 1, r) for r in range(4)
    ]
    kv.shutdown()
