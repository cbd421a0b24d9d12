"""Rows kept by workers (`rayrl.controller.kept`): a kept call's token columns stay in
the worker's object store, the driver moves references, and the next call's workers
fetch the rows they are given from the workers that hold them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import start_local_ray
from controller_toys import echo_groups
from rayrl.batch import Batch
from rayrl.controller import traffic
from rayrl.controller.kept import Directory, KeptRows


def test_taking_rows_records_runs_of_each_piece():
    pieces = ((0, range(0, 4)), (1, np.array([7, 5, 6], dtype=np.int32)))
    source = KeptRows(Directory(("a", "b")), pieces)
    assert len(source) == 7
    taken = source.take(torch.tensor([5, 6, 1, 2, 3, 4, 0]))
    named = [(taken.directory.refs[i], list(rows)) for i, rows in taken.pieces]
    assert named == [("b", [5, 6]), ("a", [1, 2, 3]), ("b", [7]), ("a", [0])]
    assert isinstance(taken.pieces[1][1], range)  # a contiguous run pickles as a range
    assert list(taken.take(torch.tensor([4, 0])).pieces[0][1]) == [3]
    assert taken.directory is source.directory  # shared: sent once per step
    both = KeptRows.concat([source, taken])
    assert len(both) == 14 and both.take(torch.tensor([])).pieces == ()
    other = KeptRows(Directory(("c", "a")), ((0, range(2)), (1, range(1))))
    merged = KeptRows.concat([source, other])  # one directory over both
    assert merged.directory.refs == ("a", "b", "c")
    assert [i for i, _ in merged.pieces] == [0, 1, 2, 0]


@pytest.fixture(scope="module")
def groups():
    """Echo groups of 4 and 2 workers on the local Ray."""
    start_local_ray()
    with echo_groups("kept", [4, 2]) as made:
        yield made


def wide(n: int, width: int) -> Batch:
    return Batch.from_dict({"x": torch.arange(n * width).reshape(n, width), "id": torch.arange(n)})


def test_a_kept_result_reaches_the_next_group_without_the_driver(groups):
    a, b = groups
    batch = wide(10, 512)
    doubled = a.double.keeping()(batch)
    assert doubled.remote.keys() == {"x"} and "rank" in doubled.tensors
    order = torch.randperm(10, generator=torch.Generator().manual_seed(0))
    with traffic.counting() as seen:
        moved = b.see_split.keeping()(doubled.index(order))
    want = (batch["x"] * 2)[order]
    assert torch.equal(moved["x"], want)  # fetched by b's ranks from a's
    assert moved["rank"].tolist() == [0] * 5 + [1] * 5
    column = batch["x"].numel() * 8
    assert sum(seen.received.values()) < column / 10  # the rows' ids and ranks, not x
    assert sum(seen.sent.values()) < column / 10  # references and row numbers
    assert not any(k.startswith("fetch:") for k in seen.received)


def test_a_kept_column_read_on_the_driver_is_fetched_there_and_counted(groups):
    a, _ = groups
    batch = wide(6, 64)
    doubled = a.double.keeping()(batch)
    with traffic.counting() as seen:
        x = doubled[2:5]["x"]
    assert torch.equal(x, batch["x"][2:5] * 2)
    assert seen.received["fetch:x"] >= x.numel() * 8
    padded, _ = doubled.pad_to_multiple(4)
    assert torch.equal(padded["x"], torch.cat([batch["x"], batch["x"][:2]]) * 2)


def test_a_union_of_kept_results_keeps_both_sources_remote(groups):
    a, _ = groups
    left = a.double.keeping()(wide(8, 16))
    right = a.sample.keeping()(Batch.from_dict({"y": torch.ones(8, 4)}), n=1)
    both = left.union(right)
    assert set(both.remote) == {"x", "y"} and len(both) == 8
    assert torch.equal(both["y"], torch.ones(8, 4))
