"""Dispatch modes on a real 4-worker group: one-to-all, all-to-all, DP split (with a
batch not divisible by the world size), rank zero, a custom mode, errors per rank, and
futures passed between groups without the driver fetching the data."""

from __future__ import annotations

import os
import time

import pytest
import ray
import torch

from conftest import start_local_ray
from controller_toys import Pickled, Tracer, echo_groups, summary
from rayrl.batch import Batch
from rayrl.controller import GroupFuture, GroupTimeoutError, WorkerCallError, traffic
from rayrl.controller.dispatch import (
    CallPlan,
    DispatchMode,
    DPState,
    MethodSpec,
    Outputs,
    collect_list,
    collect_outputs,
)
from rayrl.controller.errors import WorkerDescription
from rayrl.controller.method import GroupMethod


@pytest.fixture(scope="module")
def groups():
    """Echo groups of 4, 2 and 2 workers (0.25 CPU each) on the local Ray."""
    start_local_ray()
    with echo_groups("disp", [4, 2, 2]) as made:
        yield made


def rows(n: int, width: int = 1) -> Batch:
    return Batch.from_dict({"x": torch.arange(n * width).reshape(n, width)})


def test_one_to_all_reaches_every_rank(groups):
    a = groups[0]
    infos = a.whoami()
    assert [i["rank"] for i in infos] == [0, 1, 2, 3]
    assert len({i["pid"] for i in infos}) == 4
    assert [i["local_rank"] for i in infos] == [0, 1, 2, 3]  # all on one node
    assert a.echo({"k": [1, 2]}) == [{"k": [1, 2]}] * 4


def test_all_to_all_gives_rank_i_the_ith_element(groups):
    a = groups[0]
    assert a.add([1, 2, 3, 4], y=[10, 20, 30, 40]) == [11, 122, 233, 344]
    with pytest.raises(ValueError, match="one element per rank"):
        a.add([1, 2, 3])


def test_dp_split_pads_chunks_and_unpads_10_rows_on_4(groups):
    a = groups[0]
    batch = rows(10)
    out = a.double(batch, factor=3)  # non-Batch argument is broadcast
    assert len(out) == 10
    assert torch.equal(out["x"], batch["x"] * 3)
    # padded to 12: three rows per rank, rank 3 had 2 padding rows
    assert out["rank"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]
    assert a.sizes(batch) == [3, 3, 3, 3]


def test_rows_follow_another_groups_nodes():
    """`rows_by_node`: the rows a DP_SPLIT over 4 parts (2 per node) holds on node A go to
    the target ranks on A, evenly; None when the nodes do not line up."""
    from rayrl.controller.locality import part_rows, rows_by_node

    assert part_rows(10, 4) == [3, 3, 3, 1] and part_rows(2, 4) == [1, 1, 0, 0]
    parts = ["A", "A", "B", "B"]
    assert rows_by_node(10, parts, ["A", "B"]) == [6, 4]
    assert rows_by_node(10, parts, ["A", "A", "A", "B"]) == [2, 2, 2, 4]
    assert rows_by_node(16, parts, ["A", "A", "A", "B", "B", "B"]) == [3, 3, 2, 3, 3, 2]
    assert rows_by_node(2, parts, ["A", "B", "B"]) == [2, 0, 0]  # node B's parts: padding
    assert rows_by_node(10, parts, ["B", "A"]) is None  # the nodes in another order
    assert rows_by_node(10, ["A", "B", "A"], ["A", "B"]) is None  # a part moved to A


def test_pre_split_rows_go_to_their_ranks_in_order(groups):
    """`split_rows`' runs, a rank with none among them, reach their ranks and come back
    in row order."""
    from rayrl.controller.locality import split_rows

    batch = rows(7)
    out = groups[0].double(split_rows(batch, [3, 0, 2, 2]))
    assert torch.equal(out["x"], batch["x"] * 2)
    assert out["rank"].tolist() == [0, 0, 0, 2, 2, 3, 3]
    with pytest.raises(ValueError, match=r"sizes \[3, 3\] do not add up to 7 rows"):
        split_rows(batch, [3, 3])


def test_dp_split_unpads_when_each_row_becomes_k_rows(groups):
    out = groups[0].sample(rows(10), n=2)
    assert out["x"].flatten().tolist() == [i for i in range(10) for _ in range(2)]


def test_registered_collector_and_calls_by_name(groups):
    a = groups[0]
    assert a.rank_max() == 3  # ONE_TO_ALL, collected by the registered "max_of"
    assert a.call("rank_max") == 3 and a.call("add", [1, 2, 3, 4]) == a.add([1, 2, 3, 4])
    with pytest.raises(AttributeError, match="Echo.nope is not registered; known: .*whoami"):
        a.call("nope")
    from rayrl.controller import register

    with pytest.raises(ValueError, match="unknown collect 'no-such'; known: .*max_of"):
        register(collect="no-such")


def test_rank_zero_calls_only_rank_zero(groups):
    assert groups[0].first("hi") == (0, "hi")


def test_custom_mode_from_registry(groups):
    # odd ranks 1 and 3 answer rank + 5; collect sums them
    assert groups[0].rank_plus(5) == (1 + 5) + (3 + 5)


@pytest.mark.parametrize("shared", [True, False], ids=["shared-args", "own-args"])
def test_a_called_rank_whose_plan_has_no_kwargs_is_called_with_none(shared):
    """A plan may give a called rank None for its keyword arguments: the rank is called
    without any, whether or not its positional arguments are shared with other ranks
    (it failed, "argument after ** must be a mapping", unless they were)."""

    def dispatch(world_size: int, args: tuple, kwargs: dict) -> CallPlan:
        per_rank: list[tuple | None] = [args if shared else (r,) for r in range(world_size)]
        return CallPlan(per_rank, [None] * world_size)

    calls = []

    class Owner:  # a WorkerGroup as a GroupMethod sees it (`Caller`), calling in-process
        world_size = 2
        watchdog = None

        def _invoke(self, rank, spec, args, kwargs):
            calls.append((rank, *args, dict(**kwargs)))
            return f"ref {rank}"

        def describe(self, rank):
            return WorkerDescription(role="toy", rank=rank)

        def _note_error(self, rank, err):
            pass

        def data_layout(self, name):
            return None

    mode = DispatchMode("no-kwargs", dispatch, collect_list)
    future = GroupMethod(Owner(), MethodSpec("toy", mode, collect_list)).remote("x")
    assert future.ranks == [0, 1]
    assert calls == ([(0, "x", {}), (1, "x", {})] if shared else [(0, 0, {}), (1, 1, {})])


def test_non_blocking_calls_return_group_futures(groups):
    a = groups[0]
    fut = a.whoami(blocking=False)
    assert isinstance(fut, GroupFuture) and len(fut.refs) == 4
    assert [i["rank"] for i in fut.get()] == [0, 1, 2, 3]
    fut = a.later(4)  # registered with blocking=False
    assert isinstance(fut, GroupFuture)
    assert fut.get() == [40] * 4
    assert a.double.remote(rows(5)).get()["x"].flatten().tolist() == [0, 2, 4, 6, 8]


def test_error_names_stage_role_rank_node_pid_and_log(groups):
    a = groups[0]
    pids = [i["pid"] for i in a.whoami()]
    with pytest.raises(WorkerCallError) as info:
        a.boom(2)
    err = info.value
    assert (err.stage, err.role, err.rank, err.phase) == ("boom", "a", 2, "call")
    assert err.pid == pids[2]
    assert err.node_id == ray.get_runtime_context().get_node_id()
    assert err.log_file and os.path.exists(err.log_file)
    assert not err.dead
    text = str(err)
    for part in ("boom", "role 'a'", "rank 2", err.node_id, str(pids[2]), err.log_file):
        assert part in text
    assert "ValueError: boom on rank 2" in text  # the original remote traceback
    assert "in boom" in text and isinstance(err.cause, ValueError)  # traceback, original type
    assert a.boom(-1) == [0, 1, 2, 3]  # the group still works


def test_timeout_names_late_ranks_and_heartbeat_names_the_busy_method(groups):
    b = groups[1]
    fut = b.nap.remote(4.0)
    with pytest.raises(
        GroupTimeoutError, match=r"'nap' did not finish within 0.2 s on 2 of 2 ranks"
    ):
        fut.get(timeout=0.2)
    busy = None
    for _ in range(40):  # the health thread answers while 'nap' runs
        report = b.check_health(timeout_s=5)
        assert report.ok
        busy = {hb["busy"] for hb in report.heartbeats.values()}
        if busy == {"nap"}:
            break
        time.sleep(0.05)
    assert busy == {"nap"}
    assert fut.get(timeout=60) == [0, 1]


def _loaders(path) -> list[int]:
    return [int(line) for line in open(path).read().split()] if os.path.exists(path) else []


def test_future_moves_worker_to_worker_never_through_the_driver(groups, tmp_path):
    a, b, c = groups
    trace = str(tmp_path / "loads.txt")
    # 10 rows of 16k int64 (1.3 MB): big enough to live in the object store.
    x = torch.arange(10 * 16384).reshape(10, 16384)
    batch = Batch.from_dict({"x": x}, meta={"t": Tracer(trace)})
    fut_a = a.double.remote(batch)
    fut_b = b.double.remote(fut_a)  # 4 -> 2 ranks: re-chunked by a light remote task
    fut_c = c.double.remote(fut_b)  # 2 -> 2 ranks: rank i gets b's rank-i ref as it is
    assert fut_c.wait(timeout=120)
    loaders = _loaders(trace)
    b_pids = {i["pid"] for i in b.whoami()}
    c_pids = {i["pid"] for i in c.whoami()}
    assert os.getpid() not in loaders, "the driver deserialised data passed between groups"
    assert b_pids <= set(loaders) and c_pids <= set(loaders)
    out = fut_c.get()
    assert len(out) == 10 and torch.equal(out["x"], x * 8)
    assert out["rank"].tolist() == [0] * 5 + [1] * 5
    assert fut_b.get()["rank"].tolist() == [0] * 5 + [1] * 5


def test_future_into_broadcast_and_per_rank_modes(groups):
    a, b, c = groups
    first = a.first.remote("x")  # one ref, passed as it is
    assert b.echo(first) == [(0, "x")] * 2
    everyone = a.add.remote([1, 2, 3, 4])  # collected into one ref by a remote task
    assert b.echo(everyone) == [[1, 102, 203, 304]] * 2
    pair = b.add.remote([1, 2])  # ALL_TO_ALL: rank i gets b's rank-i ref
    assert c.add(pair) == [1 + 0, 102 + 100]
    with pytest.raises(ValueError, match="one element per rank"):
        c.add(everyone)


# Every producer x consumer dispatch-mode pair: a future passed into a call behaves
# exactly as the value its .get() returns, whatever the modes and world sizes.
PRODUCERS = {
    "one_to_all": lambda g: g.make.remote(3),
    "all_to_all": lambda g: g.add.remote(list(range(g.world_size))),
    "rank_zero": lambda g: g.make_first.remote(3),
    "dp_split": lambda g: g.double.remote(rows(5)),
    "dp_split_list": lambda g: g.sizes.remote(rows(5)),
    "custom": lambda g: g.rank_plus.remote(5),
}
CONSUMERS = ("see", "see_each", "see_first", "see_split", "see_odd")


def _outcome(method, arg):
    try:
        out = method(arg)
    except ValueError as err:
        return ("ValueError", "one element per rank" in str(err))
    return summary(out)


@pytest.mark.parametrize("producer", sorted(PRODUCERS))
def test_every_producer_into_every_consumer_acts_as_its_value(groups, producer):
    a, b, c = groups
    for source, target in ((b, c), (b, a), (a, b)):  # same size, 2 -> 4, 4 -> 2
        for consumer in CONSUMERS:
            method = getattr(target, consumer)
            value = PRODUCERS[producer](source).get()
            via_future = _outcome(method, PRODUCERS[producer](source))
            direct = _outcome(method, value)
            assert via_future == direct, (producer, consumer, source.role, target.role)


def test_a_one_rank_producer_hands_over_what_get_returns(groups):
    a, b, _ = groups
    single = b.see_odd.remote("v")  # only rank 1 of 2 is called: one ref, collected as a list
    assert len(single) == 1 and single.get() == ["v"]
    assert a.see(b.see_odd.remote("v")) == [["v"]] * 4  # [value], as .get() gives; not "v"
    assert a.see(b.see.remote("v")) == [["v", "v"]] * 4


def test_failed_producer_is_named_not_the_consumer(groups):
    a, b, _ = groups
    with pytest.raises(WorkerCallError) as info:
        b.see(a.boom.remote(2))
    assert info.value.role == "a" and info.value.rank == 2 and info.value.stage == "boom"


def test_a_large_broadcast_argument_is_serialised_once(groups):
    a = groups[0]
    big = {"blob": b"x" * 200_000, "probe": Pickled()}
    before = Pickled.count
    assert a.see(big)[0]["blob"] == big["blob"]  # ONE_TO_ALL to 4 ranks
    assert Pickled.count - before == 1  # one ray.put, the same ref for every rank
    before = Pickled.count
    a.sizes(rows(8), extra=big)  # DP_SPLIT: the non-Batch argument goes whole to each rank
    assert Pickled.count - before == 1
    small = {"probe": Pickled()}
    before = Pickled.count
    a.see(small)
    assert Pickled.count - before == 4  # small values stay inline, as Ray sends them


def test_traffic_counts_the_bytes_through_the_driver_not_those_between_workers(groups):
    a, b, _ = groups
    x = torch.arange(8 * 4096, dtype=torch.float32).reshape(8, 4096)  # 128 KiB
    batch, size = Batch.from_dict({"x": x}), x.nbytes
    a.double(batch)  # not counted: no counting block is open
    with traffic.counting() as seen:
        a.double(batch)  # 4 chunks out, 4 back
        b.double(a.double.remote(batch))  # a's result goes from a to b, not via here
    assert 2 * size < seen.sent["double"] < 2.1 * size
    assert 2 * size < seen.received["double"] < 2.1 * size
    assert seen.total == seen.sent["double"] + seen.received["double"]


def test_a_caller_may_collect_the_outputs_itself(groups):
    done = groups[0].double.remote(rows(10)).get(collect=collect_outputs)
    assert isinstance(done, Outputs) and done.state == DPState(pad=2, padded_len=12)
    assert [len(out) for out in done.outputs] == [3, 3, 3, 3]
    assert [out["rank"].tolist() for out in done.outputs][3] == [3, 3, 3]
