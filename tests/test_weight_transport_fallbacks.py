"""`async/weight_transport_fallbacks` counts each replica that missed a collective
broadcast once, for that replica: the sender's own failure is not a fallback by itself
(it made the replicas miss, and they are counted), a replica that received the
version is not counted, and each missing replica is offered the object store's copy.

The rollout manager runs with fake replicas (their `offer_weights` calls are tokens
whose result the test decides) and no Ray: the broadcast group's host is a fake too."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from rayrl.config import load_config
from rayrl.controller.replicas import Member
from rayrl.train.weight_sync import PublishedWeights
from rayrl.trainer import async_rollout
from rayrl.trainer.async_queue import QUEUED
from rayrl.trainer.async_rollout import Replica, RolloutManager
from rayrl.trainer.async_weights import CollectiveWeights, weight_sync_timeout

FALLBACKS = "async/weight_transport_fallbacks"


@dataclass(eq=False)  # a ref: hashed by identity
class Offer:
    """One `offer_weights` call: what it carried and how it ends."""

    replica: str
    version: int
    weights: PublishedWeights
    fails: bool = False


@dataclass
class FakeGroup:
    name: str
    offers: list[Offer]
    world_size: int = 1
    bundles: list = field(default_factory=lambda: [SimpleNamespace(node_id="node0")])

    def actor_handle(self, rank: int, method: str):
        def remote(version, weights, *rank_in_group):
            offer = Offer(self.name, version, weights)
            self.offers.append(offer)
            return offer

        return SimpleNamespace(offer_weights=SimpleNamespace(remote=remote))


def fake_get(offer: Offer, timeout: float):
    if offer.fails:
        raise RuntimeError(f"broadcast of policy {offer.version} timed out (planted)")
    return 1000


@pytest.fixture
def manager(monkeypatch):
    cfg = load_config(
        "grpo",
        [
            "actor_rollout_ref.rollout.mode=async",
            "rollout.n_gpus_per_node=3",
            "async_training.weight_transport=collective",
        ],
    )
    said: list[str] = []
    queue = SimpleNamespace(counts=lambda: {QUEUED: 0})
    rm = RolloutManager(cfg, queue, SimpleNamespace(run="t"), "model", 1, print_fn=said.append)
    rm.said = said
    rm.collective = CollectiveWeights("t", gpus=False, timeout_s=5.0)
    rm.abandoned = []
    rm.collective.host = SimpleNamespace(
        form=lambda n, backend, timeout: f"group of {n}", abandon=rm.abandoned.append
    )
    rm.offers = []
    names = ["r0", "r1", "r2"]
    rm.replicas = [Replica(Member(n, FakeGroup(n, rm.offers)), version=0) for n in names]
    monkeypatch.setattr(async_rollout, "ray", SimpleNamespace(get=fake_get))
    return rm


def broadcast(rm: RolloutManager, version: int, missed: set[str], sender_failed: bool):
    """One collective publish: the offers out, the trainer's publish (the object store's
    copy when the sender failed), then each replica's receive, `missed` ones failing."""
    rm.begin_collective(version)
    fallback = "actor rank 0: the group did not form in 5 s" if sender_failed else ""
    transport = "object_store" if sender_failed else "collective"
    rm.publish(version, PublishedWeights(["bucket"], 1000, transport, fallback=fallback))
    for replica in rm.replicas:
        for ref, (v, _, how) in list(replica.offers.items()):
            if v == version and how == "collective":
                ref.fails = replica.name in missed
                rm._offer_done(replica, ref)


@pytest.mark.parametrize("sender_failed", [False, True])
@pytest.mark.parametrize("missed", [set(), {"r1"}, {"r0", "r2"}])
def test_each_replica_that_missed_a_broadcast_counts_once(manager, missed, sender_failed):
    broadcast(manager, 1, missed, sender_failed)
    assert manager.metrics(0.0, 1.0)[FALLBACKS] == len(missed)
    # each missing replica, and only it, is offered the object store's copy
    store = [o.replica for o in manager.offers if o.weights.transport == "object_store"]
    assert sorted(store) == sorted(missed)
    for replica in manager.replicas:
        if replica.name not in missed:
            assert replica.version == 1 and not replica.offers
    warned = [line for line in manager.said if "missed the broadcast" in line]
    assert len(warned) == len(missed)
    assert all(any(name in line for line in warned) for name in missed)
    # the next publish forms a new group after any failure, and counts afresh
    broadcast(manager, 2, set(), sender_failed=False)
    assert manager.metrics(1.0, 2.0)[FALLBACKS] == 0


def test_a_member_lost_mid_broadcast_abandons_the_formation(manager):
    """A replica that dies while the others wait for it in a broadcast ends their wait
    at once (the host's `abandon`) and the next publish forms a new group; a replica
    lost outside any formation abandons nothing."""
    manager.set = SimpleNamespace(lose=lambda member, err: None)
    dead = ConnectionError("the replica's process is gone (planted)")
    manager._lost(manager.replicas[0], dead)  # no formation yet
    assert manager.abandoned == []
    manager.begin_collective(1)
    manager._lost(manager.replicas[0], dead)  # r1, a member of the group of 3
    assert manager.abandoned == ["group of 3"]
    assert manager.collective.stale


def test_a_replaced_sender_forms_a_new_group_and_a_dead_publish_abandons_it(manager):
    """Actor rank 0 replaced (the training group's generation moved on): the next
    publish forms a new group even with the same replicas, since they would wait for
    the dead sender's address; a publish that died abandons the formation at once."""
    first = manager.begin_collective(1, sender=0)["group"]
    assert manager.begin_collective(2, sender=0)["group"] is first  # kept while all live
    formed = []
    manager.collective.host.form = lambda n, backend, timeout: formed.append(n) or f"new {n}"
    assert manager.begin_collective(3, sender=1)["group"] == "new 4"  # rank 0 replaced
    assert formed == [4] and manager.abandoned == []
    manager.sender_lost()  # its publish died with the replicas waiting for it
    assert manager.abandoned == ["new 4"] and manager.collective.stale


def test_objects_lost_with_their_owner_are_published_again_not_fetched_forever(manager):
    """A version whose objects died with the process that put them (actor rank 0
    killed after its publish): the replica that could not fetch it says so once, is not
    offered the lost objects again (it would fail again, every moment, for as long as
    the run waits), and takes the trainer's next publish."""
    manager.publish(1, PublishedWeights(["bucket"], 1000, "object_store"))
    replica = manager.replicas[0]
    (ref,) = list(replica.offers)
    ref.fails = True  # the object's owner is gone
    manager._offer_done(replica, ref)
    assert manager.needs_publish
    before = len(manager.offers)
    manager._offer(replica)  # what the dispatch loop does each moment
    assert len(manager.offers) == before
    assert sum("could not fetch policy 1" in line for line in manager.said) == 1
    manager.publish(1, PublishedWeights(["again"], 1000, "object_store"))
    assert not manager.needs_publish
    assert [o.weights.refs for o in manager.offers[before:]][0] == ["again"]


def test_each_replica_has_its_own_rank_after_the_senders():
    """Actor rank 0 sends as rank 0 of the group; the replicas are ranks 1..n, one each
    (a replica on rank 0 would wait for a send of its own)."""
    weights = CollectiveWeights("t", gpus=False, timeout_s=5.0)
    weights.host = SimpleNamespace(form=lambda n, backend, timeout: f"group of {n}")
    plan = weights.plan(["r0", "r1", "r2"])
    assert plan.group == "group of 4" and plan.ranks == {"r0": 1, "r1": 2, "r2": 3}
    assert weights.plan([]) is None


@pytest.mark.parametrize(
    ("keys", "bound"),
    [
        (["async_training.weight_sync_timeout_s=7", "trainer.stage_timeout_s=11"], 7.0),
        (["trainer.stage_timeout_s=11"], 11.0),
        (["async_training.weight_sync_timeout_s=7"], 7.0),
    ],
)
def test_the_weight_sync_bound_is_its_own_key_then_the_stage_timeout(keys, bound):
    cfg = load_config(
        "grpo",
        [
            "actor_rollout_ref.rollout.mode=async",
            "rollout.n_gpus_per_node=1",
            "async_training.weight_transport=collective",
            *keys,
        ],
    )
    assert weight_sync_timeout(cfg) == bound
