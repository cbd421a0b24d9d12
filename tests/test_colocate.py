"""Colocation: two roles fused into one actor per bundle share a process and its state,
and each role's view dispatches its own registered methods."""

from __future__ import annotations

import os
import uuid

import pytest

from controller_toys import reserve
from rayrl.batch import Batch
from rayrl.controller import (
    DP_SPLIT,
    ONE_TO_ALL,
    RANK_ZERO,
    Worker,
    WorkerCallError,
    WorkerGroup,
    colocate,
    register,
)


class Store(Worker):
    """The 'actor' role: holds a value other roles of the process can read."""

    def __init__(self, start: int = 0) -> None:
        self.value = start

    def init_worker(self, scale: int = 1) -> None:
        self.value *= scale

    @register(dispatch=ONE_TO_ALL)
    def set_value(self, value: int) -> int:
        self.value = value + self.rank
        return os.getpid()

    @register(dispatch=DP_SPLIT, collect="list")
    def count(self, items) -> tuple:
        return (self.role, self.rank, len(items))


class Reader(Worker):
    """The 'ref' role: reads the Store of its own process through `self.peers`."""

    def init_worker(self, tag: str = "") -> None:
        self.tag = tag

    @register(dispatch=ONE_TO_ALL)
    def read_peer(self) -> tuple:
        return (os.getpid(), self.peers["actor"].value, self.tag, self.role)

    @register(dispatch=RANK_ZERO)
    def fail(self) -> None:
        raise KeyError("reader failed")


def test_roles_share_one_process_and_each_view_dispatches(ray_local):
    run = f"colo-{uuid.uuid4().hex[:6]}"
    pool = reserve(run, [2], {"CPU": 0.5})
    Fused = colocate({"actor": Store, "ref": Reader})
    try:
        with WorkerGroup(
            Fused,
            pool.bundles,
            role="actor_ref",
            run=run,
            kwargs={"roles_args": {"actor": {"start": 3}}},
        ) as group:
            group.create(timeout_s=60).init(timeout_s=60, actor={"scale": 2}, ref={"tag": "r"})
            actor, ref = group.view("actor"), group.view("ref")
            assert ref.read_peer() == [(p, 6, "r", "ref") for p in [i["pid"] for i in group.infos]]
            pids = actor.set_value(10)
            seen = ref.read_peer()
            assert [s[0] for s in seen] == pids  # same process for both roles
            assert [s[1] for s in seen] == [10, 11]  # ref sees actor's state
            counts = actor.count(Batch.from_dict({"v": list(range(5))}))
            assert counts == [("actor", 0, 3), ("actor", 1, 3)]  # 5 rows padded to 6
            with pytest.raises(WorkerCallError, match=r"role 'ref \(in actor_ref\)' rank 0"):
                ref.fail()
            with pytest.raises(AttributeError):
                ref.set_value  # noqa: B018 - views expose only their role's methods
            assert ref.call("read_peer") == seen  # by name, as ref.read_peer()
            with pytest.raises(
                AttributeError, match="role 'ref' has no registered method 'set_value'"
            ):
                ref.call("set_value", 1)
            with pytest.raises(ValueError, match="roles"):
                group.init(critic={})
    finally:
        pool.teardown()
