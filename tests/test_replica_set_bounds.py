"""The elastic replica set never holds more than its maximum: replicas running, starting
and requested together stay at or below `max_size` after every change (a replica lost
on a live node or with its node, a request placed, a start or a replacement that
succeeds or fails, nodes checked), and every extra bundle it claimed is either in use
by a live replica or given back.

The pool, the groups and Ray's view of the nodes are fakes that keep the ground truth
(requests open at the pool, groups not shut down, extra bundles claimed and not given
back); the set's replacement threads are run by the test, one at a time, in a random
order, so the changes interleave as they can in a run. No Ray."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from rayrl.controller import replicas
from rayrl.controller.replicas import ReplicaSet


@dataclass(frozen=True)
class FakePG:
    id: str


@dataclass(frozen=True)
class FakeBundle:
    pg: FakePG
    index: int
    node_id: str


class FakePool:
    """request_extra / claim_extra / cancel_extra / release_extra as the real pool's,
    keeping what is open and what is claimed."""

    def __init__(self, size: int, ranks: int) -> None:
        self.run = "run"
        self.spec = SimpleNamespace(name="rollout", world_size=size)
        own = FakePG("own")
        self.bundles = [FakeBundle(own, i, f"node{i // ranks}") for i in range(size)]
        self.open: dict[object, SimpleNamespace] = {}
        self.claimed: set[str] = set()
        self._ids = itertools.count()

    def request_extra(self, count: int = 1) -> SimpleNamespace:
        n = next(self._ids)
        request = SimpleNamespace(pg=FakePG(f"extra{n}"), count=count, ready=f"ready{n}")
        self.open[request.ready] = request
        return request

    def claim_extra(self, request) -> list[FakeBundle]:
        assert self.open.pop(request.ready) is request, "claimed a request not open"
        self.claimed.add(request.pg.id)
        node = f"new-{request.pg.id}"
        return [FakeBundle(request.pg, i, node) for i in range(request.count)]

    def cancel_extra(self, request) -> None:
        self.open.pop(request.ready, None)

    def release_extra(self, bundle: FakeBundle) -> None:
        self.claimed.discard(bundle.pg.id)


@dataclass
class World:
    """The nodes alive, the groups made, and which starts are to fail."""

    alive: set[str] = field(default_factory=set)
    groups: list = field(default_factory=list)
    fail: float = 0.0
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def maybe_fail(self, what: str) -> None:
        if self.rng.random() < self.fail:
            raise RuntimeError(f"{what} failed (planted)")


class FakeGroup:
    def __init__(self, world: World, name: str, bundles: list[FakeBundle]) -> None:
        self.world, self.name, self.bundles = world, name, list(bundles)
        self.world_size = len(bundles)
        self.shut = False
        world.groups.append(self)
        for bundle in bundles:
            world.alive.add(bundle.node_id)  # a placed bundle is on a live node

    def create(self, timeout_s: float) -> None:
        self.world.maybe_fail("create")

    def init(self, timeout_s: float, retries: int, **kwargs) -> None:
        self.world.maybe_fail("init")

    def replace(self, ranks, timeout_s: float, retries: int) -> None:
        self.world.maybe_fail("replace")

    def shutdown(self) -> None:
        self.shut = True


def make_set(monkeypatch, size: int, max_size: int, ranks: int = 1, fail: float = 0.0):
    world = World(fail=fail)
    pool = FakePool(size, ranks)
    world.alive |= {b.node_id for b in pool.bundles}
    threads: list = []
    monkeypatch.setattr(replicas, "alive_nodes", lambda: set(world.alive))
    monkeypatch.setattr(replicas, "start_groups", lambda groups, **kw: None)
    monkeypatch.setattr(ReplicaSet, "_in_thread", lambda self, fn: threads.append(fn))
    rs = ReplicaSet(
        pool,
        lambda name, bundles: FakeGroup(world, name, bundles),
        dict,
        max_size=max_size,
        print_fn=lambda m: None,
        ranks_per_replica=ranks,
    )
    return rs, pool, world, threads


def check(rs: ReplicaSet, pool: FakePool, world: World, what: str) -> None:
    """The ground truth: live groups and open requests within the maximum, the set's
    own count the same, no claimed extra bundle without a live group on it."""
    live = [g for g in world.groups if not g.shut]
    held = len(live) + len(pool.open)
    assert held <= rs.max_size, f"after {what}: {held} replicas and requests > {rs.max_size}"
    assert rs.size == held, f"after {what}: the set counts {rs.size}, the fakes hold {held}"
    used = {b.pg.id for g in live for b in g.bundles}
    assert pool.claimed <= used, f"after {what}: extra bundles kept unused: {pool.claimed - used}"


def test_a_set_above_its_pool_asks_for_the_rest_and_no_more(monkeypatch):
    rs, pool, world, threads = make_set(monkeypatch, size=2, max_size=4)
    rs.start()
    check(rs, pool, world, "start")
    assert len(rs.members) == 2 and len(pool.open) == 2
    for ref in list(rs.pending):
        rs.placed(ref)
        check(rs, pool, world, "placed")
    while threads:
        threads.pop(0)()
        check(rs, pool, world, "joined")
    assert len(rs.members) == 4 and not pool.open
    gone = rs.members[-1]
    world.alive.discard(gone.node)
    rs.check_nodes(list(rs.members))  # its node is gone: one request in its place
    check(rs, pool, world, "node gone")
    assert len(rs.members) == 3 and len(pool.open) == 1 and gone.group.shut
    rs.lose(rs.members[0], RuntimeError("killed"))  # node alive: replaced in place
    check(rs, pool, world, "lost on a live node")
    rs.lose(gone, RuntimeError("again"))  # no longer a member: nothing changes
    check(rs, pool, world, "lost twice")
    rs.stop()
    assert not pool.open
    while threads:  # the replacement in flight finds the set stopped
        threads.pop(0)()
    assert all(g.shut for g in world.groups) and not rs.members


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("ranks", [1, 2])
def test_random_losses_placements_and_failed_starts_never_pass_the_maximum(
    monkeypatch, seed, ranks
):
    rng = random.Random(seed)
    size = ranks * rng.choice([1, 2, 3])
    rs, pool, world, threads = make_set(
        monkeypatch, size, max_size=size // ranks + rng.choice([0, 1, 3]), ranks=ranks, fail=0.3
    )
    world.rng = random.Random(seed + 100)
    rs.start()
    check(rs, pool, world, "start")
    for step in range(150):
        if rs.error is not None:  # too many failed starts: the run would stop here
            rs._failed_starts = 0
            rs.error = None
        op = rng.choice(["lose", "lose_node", "placed", "thread", "thread", "nodes"])
        if op in ("lose", "lose_node") and rs.members:
            member = rng.choice(rs.members)
            if op == "lose_node":
                world.alive.discard(member.node)
            rs.lose(member, RuntimeError("lost"))
        elif op == "placed" and rs.pending:
            rs.placed(rng.choice(rs.pending))
        elif op == "thread" and threads:
            threads.pop(rng.randrange(len(threads)))()
        elif op == "nodes":
            rs.check_nodes(list(rs.members))
        check(rs, pool, world, f"step {step} ({op})")
    while threads:
        threads.pop(0)()
        check(rs, pool, world, "the last starts")
    rs.stop()
    assert not pool.open


@pytest.mark.parametrize("broken", ["claim", "make"])
def test_a_group_that_cannot_be_made_gives_its_bundles_back_and_is_asked_for_again(
    monkeypatch, broken
):
    rs, pool, world, threads = make_set(monkeypatch, size=1, max_size=2)
    rs.start()
    (ref,) = rs.pending
    if broken == "claim":
        monkeypatch.setattr(pool, "claim_extra", lambda request: 1 / 0)
    else:
        rs.make_group = lambda name, bundles: 1 / 0
    rs.placed(ref)
    check(rs, pool, world, f"a failed {broken}")
    assert rs.starting == 0 and len(pool.open) == 1 and ref not in pool.open
    assert rs._failed_starts == 1 and not threads


def test_the_rollout_manager_grows_its_set_to_max_replicas(monkeypatch):
    """rollout.max_replicas above the declared replicas (2 GPUs): the rollout manager's
    set starts 2 replicas on the pool and asks the cluster for 2 more, and no more;
    without it, for none."""
    from rayrl.config import load_config
    from rayrl.trainer.async_rollout import RolloutManager

    def requests(extra: list[str]) -> tuple[int, int]:
        cfg = load_config(
            "grpo", ["actor_rollout_ref.rollout.mode=async", "rollout.n_gpus_per_node=2", *extra]
        )
        rm = RolloutManager(cfg, SimpleNamespace(), SimpleNamespace(run="t"), "model", 1)
        _, pool, world, _ = make_set(monkeypatch, size=2, max_size=2)
        monkeypatch.setattr(rm, "_group", lambda name, bundles: FakeGroup(world, name, bundles))
        monkeypatch.setattr(rm, "_thread", SimpleNamespace(start=lambda: None, is_alive=bool))
        rm.start(pool)
        return len(rm.replicas), len(pool.open)

    assert requests(["rollout.max_replicas=4"]) == (2, 2)
    assert requests([]) == (2, 0)
