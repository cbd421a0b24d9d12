"""ResourceGuard: the fit search, the three verdicts, bounded waits, CPU warnings, plan."""

from __future__ import annotations

import threading
import time
import warnings

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group

from rayrl.cluster.fit import pack, pool_units
from rayrl.cluster.guard import (
    CpuOversubscribed,
    ResourcesBusy,
    ResourcesUnsatisfiable,
    assess,
    check,
    render_plan,
)
from rayrl.cluster.inspect import ClusterState, GroupInfo, NodeInfo, snapshot
from rayrl.cluster.pool import ResourcePool
from rayrl.cluster.spec import PoolSpec
from rayrl.cluster.tables import render_text

GPU = {"GPU": 1.0, "CPU": 1.0}


def _nodes(*gpus: int) -> dict[str, dict[str, float]]:
    return {f"n{i}": {"GPU": float(g), "CPU": 8.0} for i, g in enumerate(gpus)}


# -- pure fit search ------------------------------------------------------------------


def test_strict_pack_groups_go_to_distinct_nodes_in_node_order():
    units = pool_units(PoolSpec("p", [2, 2], GPU))
    result = pack(units, _nodes(4, 4))
    assert result.assignment == ["n0", "n1"]  # same cluster, same answer
    assert not pack(units, _nodes(4)).fits  # two groups need two nodes
    assert not pack(pool_units(PoolSpec("p", [8], GPU)), _nodes(4, 4)).fits


def test_pack_backtracks_and_spares_go_anywhere():
    # Greedy largest-first into n0 would block the 3-GPU group; the search must find n1.
    units = pool_units(PoolSpec("a", [3], GPU)) + pool_units(PoolSpec("b", [2, 1], GPU))
    result = pack(units, {"n0": {"GPU": 3.0, "CPU": 8}, "n1": {"GPU": 4.0, "CPU": 8}})
    assert result.fits
    spares = pool_units(PoolSpec("s", [2], GPU, strategy="SPREAD", capacity_factor=2.0))
    assert [u.kind for u in spares] == ["bundle", "bundle", "spare", "spare"]
    assert pack(spares, _nodes(1, 1, 1, 1)).fits
    assert not pack(spares, _nodes(1, 1, 1)).fits


def test_strict_spread_needs_distinct_nodes_and_budget_is_reported():
    units = pool_units(PoolSpec("s", [3], GPU, strategy="STRICT_SPREAD"))
    assert pack(units, _nodes(2, 2, 2)).fits
    assert not pack(units, _nodes(8, 8)).fits
    tiny = pack(pool_units(PoolSpec("p", [2, 2], GPU)), _nodes(1, 1, 4, 4), budget=2)
    assert not tiny.fits and tiny.exhausted  # gave up: not a proof of "never"
    assert pack(pool_units(PoolSpec("p", [2, 2], GPU)), _nodes(1, 1, 4, 4)).assignment == [
        "n2",
        "n3",
    ]


def test_ten_thousand_bundles_without_recursion():
    # One level per unit used to raise RecursionError from about 1,000 bundles.
    nodes = {f"n{i:04d}": {"GPU": 8.0, "CPU": 64.0} for i in range(1250)}
    units = pool_units(PoolSpec("p", [10_000], GPU, strategy="PACK"))
    result = pack(units, nodes)
    assert result.fits and len(result.assignment) == 10_000
    assert result.assignment[:9] == ["n0000"] * 8 + ["n0001"]
    assert not pack(pool_units(PoolSpec("p", [10_001], GPU, strategy="PACK")), nodes).fits


def test_cpu_limits_the_fit_per_node_and_in_all():
    # GPUs are plentiful: only CPUs can say no.
    nodes = {"n0": {"GPU": 8.0, "CPU": 4.0}, "n1": {"GPU": 8.0, "CPU": 4.0}}
    heavy = {"GPU": 1.0, "CPU": 3.0}
    assert not pack(pool_units(PoolSpec("p", [2], heavy)), nodes).fits  # 6 CPUs on one node
    assert pack(pool_units(PoolSpec("p", [1, 1], heavy)), nodes).fits
    assert not pack(pool_units(PoolSpec("p", [3], heavy, strategy="PACK")), nodes).fits
    never = assess([PoolSpec("p", [2], heavy)], _fake_cluster([4, 4], cpus=4))
    assert never.status == "never" and "CPU 6" in never.reason and "CPU 4" in never.reason


def test_an_aligned_pool_follows_its_partner_node_by_node():
    """A pool with `align_with` puts its per-node group i on the node of the partner's
    group i: the search places both as one, so it backtracks to nodes with room for both."""
    workers = PoolSpec("w", [2, 2], GPU)
    helpers = PoolSpec("h", [1, 1], {"CPU": 3.0}, align_with="w")
    units = pool_units(workers) + pool_units(helpers)
    assert [u.align for u in units] == [None, None, "w", "w"]
    # n0 has GPUs but too few CPUs for a worker group and its helper: both skip it
    nodes = {
        "n0": {"GPU": 2.0, "CPU": 4.0},
        "n1": {"GPU": 2.0, "CPU": 5.0},
        "n2": {"GPU": 2.0, "CPU": 8.0},
    }
    assert pack(units, nodes).assignment == ["n1", "n2", "n1", "n2"]
    assert not pack(units, {k: nodes[k] for k in ("n0", "n1")}).fits
    never = assess([workers, helpers], _fake_cluster([4, 4], cpus=4))
    assert never.status == "never"
    assert "pool 'h' follows pool 'w' node by node (align_with)" in never.reason
    fits = assess([workers, helpers], _fake_cluster([4, 4], cpus=8))
    assert fits.status == "fits" and fits.nodes_for("h") == fits.nodes_for("w")
    assert "STRICT_PACK on w's nodes" in render_text(render_plan([workers, helpers], fits.cluster))
    with pytest.raises(ValueError, match="aligns its per-node group 0 with pool 'w'"):
        assess([helpers], _fake_cluster([4, 4]))
    with pytest.raises(ValueError, match=r"both need as many per-node groups; got \[1\] and"):
        assess([workers, PoolSpec("h", [1], {"CPU": 1.0}, align_with="w")], _fake_cluster([4]))
    with pytest.raises(ValueError, match="align_with='w' needs strategy STRICT_PACK"):
        PoolSpec("h", [1], {"CPU": 1.0}, strategy="PACK", align_with="w")


def _fake_cluster(
    free_gpus: list[int], groups: list[GroupInfo] = (), cpus: float = 8.0
) -> ClusterState:
    nodes = [
        NodeInfo(
            f"{i:02d}" * 14,
            "10.0.0.1",
            i == 0,
            {"GPU": 4.0, "CPU": cpus},
            {"GPU": float(f), "CPU": cpus},
        )
        for i, f in enumerate(free_gpus)
    ]
    return ClusterState(nodes, list(groups), {})


def test_three_verdicts_without_ray():
    assert assess([PoolSpec("p", [4, 4], GPU)], _fake_cluster([4, 4])).status == "fits"
    stale = GroupInfo(
        "ab" * 9,
        "rayrl/old/x",
        "CREATED",
        "STRICT_PACK",
        "02000000",
        True,
        True,
        "ns",
        [{"GPU": 4.0}],
        ["01" * 14],
    )
    busy = assess([PoolSpec("p", [4, 4], GPU)], _fake_cluster([4, 0], [stale]))
    assert busy.status == "busy" and busy.nodes_for("p") == ["00" * 14, "01" * 14]
    plan = render_text(render_plan([PoolSpec("p", [4, 4], GPU)], busy.cluster))
    assert (
        "BUSY" in plan and "rayrl/old/x" in plan and "STALE" in plan and "GPU 4 on 01010101" in plan
    )
    never = assess([PoolSpec("p", [8], GPU)], _fake_cluster([4, 4]))
    assert never.status == "never"
    assert (
        "needs 8 x (GPU 1, CPU 1) on one node, that is GPU 8; the most any node has is GPU 4"
        in never.reason
    )


# -- real Ray ------------------------------------------------------------------------


def test_fits_now_and_plan_renders(ray_local):
    pools = [PoolSpec("actor", [2], GPU), PoolSpec("rollout", [1], GPU, capacity_factor=2.0)]
    verdict = assess(pools, snapshot())
    assert verdict.status == "fits", verdict.reason
    text = render_text(render_plan(pools, snapshot()))
    for needle in ("actor", "rollout", "STRICT_PACK", "GPU 1, CPU 1", "FITS", "CPU budget"):
        assert needle in text, text


def test_cpu_bound_request_that_ray_could_never_place_is_never(ray_local):
    # ray_local has 8 CPUs and 4 GPUs on one node: 9 CPUs in one bundle never fit.
    verdict = assess([PoolSpec("cpu", [1], {"CPU": 9.0})], snapshot())
    assert verdict.status == "never" and "CPU 9" in verdict.reason, verdict.reason
    assert assess([PoolSpec("cpu", [1], {"CPU": 8.0})], snapshot()).status == "fits"


def test_busy_request_waits_bounded_and_names_the_holder(ray_local, caplog):
    holder = placement_group([{"GPU": 4.0}], strategy="STRICT_PACK", name="rayrl/other/holder")
    assert holder.wait(10)
    try:
        start = time.monotonic()
        with pytest.raises(ResourcesBusy) as err:
            check([PoolSpec("rollout", [1], GPU)], timeout_s=1.5, poll_s=0.2)
        waited = time.monotonic() - start
        assert 1.4 <= waited < 8, waited
        text = str(err.value)
        assert "rayrl/other/holder" in text and "running" in text and "GPU 4" in text
        assert "STALE" not in text  # its job (this test) is alive
        assert any("rayrl/other/holder" in r.getMessage() for r in caplog.records)
    finally:
        remove_placement_group(holder)


def test_wait_succeeds_when_holder_releases(ray_local):
    holder = placement_group([{"GPU": 4.0}], strategy="STRICT_PACK", name="rayrl/other/brief")
    assert holder.wait(10)
    timer = threading.Timer(1.0, remove_placement_group, args=(holder,))
    timer.start()
    try:
        start = time.monotonic()
        verdict = check([PoolSpec("rollout", [2], GPU)], timeout_s=20, poll_s=0.2)
        assert verdict.status == "fits"
        assert 0.9 <= time.monotonic() - start < 15
    finally:
        timer.join()


def test_cpu_oversubscription_warns(ray_local):
    # ray_local has 8 CPUs; 4 workers x (3 loader workers + 1) = 16 > 8.
    heavy = PoolSpec("loaders", [4], {"CPU": 1.0}, loader_workers=3)
    pool = ResourcePool(heavy, run="cpu")
    with pytest.warns(CpuOversubscribed, match="16 CPUs"):
        pool.bootstrap(timeout_s=20)
    pool.teardown()
    light = PoolSpec("loaders", [4], {"CPU": 1.0}, loader_workers=1)  # 8 of 8: fine
    with warnings.catch_warnings():
        warnings.simplefilter("error", CpuOversubscribed)
        check([light], timeout_s=10)
    assert "OVER-SUBSCRIBED" in render_text(render_plan([heavy], snapshot()))


# -- holders outside placement groups, autoscaling ---------------------------------

AUTOSCALER = {"source": "test", "node_types": [], "max_resources": {}}


@ray.remote(num_gpus=4, num_cpus=0)
class GpuHog:
    def ready(self) -> bool:
        return True


def test_busy_report_names_actors_outside_placement_groups(ray_local):
    hog = GpuHog.options(name="gpu-hog").remote()
    ray.get(hog.ready.remote(), timeout=60)
    try:
        with pytest.raises(ResourcesBusy) as err:
            check([PoolSpec("rollout", [1], GPU)], timeout_s=0.5, poll_s=0.1)
        table = err.value.table
        assert "Holders outside placement groups" in table, table
        assert "actor gpu-hog (GpuHog)" in table and "GPU 4" in table, table
    finally:
        ray.kill(hog)


def test_with_an_autoscaler_never_becomes_a_bounded_wait_naming_the_request(ray_local):
    big = [PoolSpec("huge", [1], {"CPU": 9.0})]  # the one node has 8 CPUs
    assert assess(big, snapshot()).status == "never"
    start = time.monotonic()
    with pytest.raises(ResourcesUnsatisfiable) as err:
        check(big, timeout_s=1.0, poll_s=0.2, autoscaler=AUTOSCALER)
    assert 0.9 <= time.monotonic() - start < 8
    text = str(err.value)
    assert "autoscaler added no room" in text and "asked for: 1 x {CPU 9}" in text, text
    # Node types that can never hold the bundle: no point waiting.
    small = {
        **AUTOSCALER,
        "node_types": [{"name": "w", "resources": {"CPU": 4.0}, "max_count": 10}],
    }
    start = time.monotonic()
    with pytest.raises(ResourcesUnsatisfiable, match="no node type the autoscaler may add"):
        check(big, timeout_s=30, autoscaler=small)
    assert time.monotonic() - start < 5


@pytest.mark.slow
def test_autoscaling_wait_ends_when_a_node_joins(ray_multinode):
    cluster = ray_multinode([{"num_cpus": 1}])
    pools = [PoolSpec("wide", [1], {"CPU": 3.0})]
    found: dict = {}

    def guard() -> None:
        try:
            found["verdict"] = check(pools, timeout_s=60, poll_s=0.2, autoscaler=AUTOSCALER)
        except Exception as err:  # noqa: BLE001 - reported below
            found["error"] = err

    waiting = threading.Thread(target=guard)
    start = time.monotonic()
    waiting.start()
    time.sleep(1.0)
    assert waiting.is_alive(), found  # "never" on these nodes became a wait
    cluster.add_node(num_cpus=4)  # Ray starts nodes from the main thread only
    waiting.join(timeout=60)
    verdict = found.get("verdict")
    assert verdict is not None and verdict.status == "fits", found
    assert time.monotonic() - start >= 1.0
    assert verdict.cluster.node(verdict.nodes_for("wide")[0]).total["CPU"] == 4.0  # the new node
