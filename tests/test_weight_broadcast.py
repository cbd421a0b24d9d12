"""The collective weight transport (`async_training.weight_transport=collective`) on
real Ray processes with gloo: the broadcast group delivers packed weights byte for
byte, a group that cannot form falls back to the object store within its bound, and
async runs with the collective transport are exact (staleness 0) and survive a
replica SIGKILLed mid-run."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import ray
import torch

from rayrl.cluster.broadcast import BroadcastHost, BroadcastMember
from rayrl.testing.chaos import deterministic, final_weights
from rayrl.train.weight_sync import PublishedWeights
from rayrl.workers.weight_transport import publish_packed, receive_packed


@pytest.fixture(scope="module")
def async_model(tmp_path_factory) -> str:
    from rayrl.models import build_tiny_model

    out = tmp_path_factory.mktemp("bcast-model") / "tiny"
    return str(build_tiny_model(out, layers=2, hidden=64, seed=1, overwrite=True))


@ray.remote(num_cpus=0)
class Receiver:
    """A replica's receiving end, in a process of its own."""

    def __init__(self) -> None:
        self.member = BroadcastMember()

    def receive(self, offer: PublishedWeights, rank: int) -> list:
        buckets = receive_packed(self.member, offer, rank, torch.device("cpu"))
        return [(b.names, b.shapes, b.flat.view(torch.uint8).clone()) for b in buckets]

    def generation(self) -> str:
        return self.member.spec.prefix if self.member.spec else ""


def weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    """Tensors of two dtypes (so two buckets at least), random bytes."""
    gen = torch.Generator().manual_seed(seed)
    out = [(f"layer{i}.w", torch.randn(33, 17, generator=gen)) for i in range(3)]
    out += [(f"layer{i}.b", torch.randn(17, generator=gen).bfloat16()) for i in range(2)]
    return out


def publish_to(receivers, host: BroadcastHost, sender: BroadcastMember, seed: int, timeout=30):
    spec = host.form(len(receivers) + 1, "gloo", timeout)
    offer = PublishedWeights([], 0, "collective", group=spec, key=f"v{seed}")
    pending = [r.receive.remote(offer, rank) for rank, r in enumerate(receivers, start=1)]
    published = publish_packed(weights(seed), sender, "collective", spec, offer.key, "cpu")
    return published, pending


def test_the_broadcast_delivers_identical_buckets_and_falls_back_within_its_bound(ray_local):
    receivers = [Receiver.remote() for _ in range(2)]
    host, sender = BroadcastHost("test-weights"), BroadcastMember()
    for seed in (1, 2):  # a second publish on a new generation: the old group is dropped
        published, pending = publish_to(receivers, host, sender, seed)
        assert published.transport == "collective" and not published.fallback
        want = ray.get(published.refs)  # the object store's copy, for late joiners
        for got in ray.get(pending, timeout=60):
            assert len(got) == len(want) >= 2
            for (names, shapes, raw), bucket in zip(got, want, strict=True):
                assert (names, shapes) == (bucket.names, bucket.shapes)
                assert torch.equal(raw, bucket.flat.view(torch.uint8))
    assert sender.sent_bytes == sum(b.nbytes for b in want) * 2
    assert ray.get(receivers[0].generation.remote()) == "test-weights/gen2"
    # a member that never joins: the sender gives up within the bound, and the version
    # goes by the object store, saying why
    spec = host.form(3, "gloo", 3)
    offer = PublishedWeights([], 0, "collective", group=spec, key="lonely")
    late = receivers[0].receive.remote(offer, 1)
    published = publish_packed(weights(3), sender, "collective", spec, "lonely", "cpu")
    assert published.transport == "object_store" and "actor rank 0" in published.fallback
    assert sender.spec is None and len(ray.get(published.refs)) >= 2
    with pytest.raises(ray.exceptions.RayTaskError):
        ray.get(late, timeout=60)


def test_a_formation_abandoned_for_a_lost_member_ends_every_wait_at_once(ray_local):
    """A member that never comes (a replica dead before it joined) would hold the
    sender and the others for the group's whole bound (here 120 s); the host's
    `abandon` ends every wait within a moment, the sender's version goes by the object
    store, and the group forms anew."""
    receivers = [Receiver.remote() for _ in range(1)]
    host, sender = BroadcastHost("abandon-weights"), BroadcastMember()
    spec = host.form(3, "gloo", 120)  # rank 2 never comes
    offer = PublishedWeights([], 0, "collective", group=spec, key="v1")
    waiting = receivers[0].receive.remote(offer, 1)
    threading.Timer(2.0, host.abandon, args=(spec,)).start()
    start = time.monotonic()
    published = publish_packed(weights(1), sender, "collective", spec, "v1", "cpu")
    assert time.monotonic() - start < 15  # not the group's 120 s
    assert published.transport == "object_store" and "abandoned" in published.fallback
    with pytest.raises(ray.exceptions.RayTaskError, match="abandoned"):
        ray.get(waiting, timeout=30)
    again, pending = publish_to(receivers, host, sender, seed=2)  # a new formation works
    (buckets,) = ray.get(pending, timeout=60)
    assert again.transport == "collective" and len(buckets) >= 2


def test_a_collective_offer_without_a_group_is_refused_by_name():
    """An offer that says ``collective`` but names no group (never made by
    `publish_packed` or `RolloutManager.begin_collective`) fails with the offer's key,
    and the member is left outside any group."""
    member = BroadcastMember()
    offer = PublishedWeights([], 0, "collective", key="rollout-weights/v3")
    with pytest.raises(ValueError, match="'rollout-weights/v3' names no broadcast group"):
        receive_packed(member, offer, 1, torch.device("cpu"))
    assert member.spec is None and member.rank == -1


@pytest.mark.slow
def test_collective_staleness_zero_run_equals_the_object_store_run_bitwise(
    ray_local, async_model, tmp_path
):
    from test_async_training import EXACT, fit

    three = ["trainer.total_training_steps=3", "trainer.resume_mode=disable"]
    _, base, _ = fit(async_model, tmp_path / "store", [*EXACT, *three])
    run, history, printed = fit(
        async_model,
        tmp_path / "bcast",
        [*EXACT, *three, "async_training.weight_transport=collective"],
    )
    assert len(history) == len(base) == 3
    for want, got in zip(base, history, strict=True):
        same = {k: v for k, v in deterministic(want).items() if not k.startswith("async/")}
        assert {k: got.get(k) for k in same} == same
    weights_a, weights_b = final_weights(tmp_path / "store"), final_weights(tmp_path / "bcast")
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    # the policies went through the group, never by the object store instead
    assert sum(row["async/weight_transport_fallbacks"] for row in history) == 0, printed
    assert sum(row["async/weight_broadcast_bytes"] for row in history) > 0
    assert not any("missed the broadcast" in line for line in printed)
    # no replica was ever offered the object store's copy instead
    assert run.trainer.rollouts.offers_made == {"object_store": 0, "collective": 2}, printed


class BroadcastKiller:
    """SIGKILLs the first replica's process while a collective offer of policy
    `version` or later is in flight to it (it is joining the group or receiving)."""

    def __init__(self, run, version: int = 2) -> None:
        self.run, self.version = run, version
        self.killed: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        pid = None
        while not self._stop.is_set() and not self.killed:
            rollouts = self.run.trainer.rollouts if self.run.trainer else None
            replicas = list(rollouts.replicas) if rollouts is not None else []
            if not replicas:
                time.sleep(0.05)
                continue
            if pid is None:  # asked once, ahead: the kill itself must be quick
                pid = ray.get(replicas[0].group.actors[0].heartbeat.remote(), timeout=30)["pid"]
            offers = list(replicas[0].offers.values())
            if any(v >= self.version and how == "collective" for v, _, how in offers):
                os.kill(pid, signal.SIGKILL)
                self.killed.append(pid)
            time.sleep(0.002)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


@pytest.mark.slow
def test_a_replica_killed_while_a_broadcast_runs_loses_no_prompt(ray_local, async_model, tmp_path):
    from test_async_training import ASYNC, fit

    steps = 4
    extra = [
        *ASYNC,
        "rollout.n_gpus_per_node=2",
        "async_training.weight_transport=collective",
        "async_training.weight_sync_timeout_s=10",
        "async_training.staleness_threshold=1",
        "async_training.partial_rollout=true",
        f"trainer.total_training_steps={steps}",
        "trainer.resume_mode=disable",
    ]
    killer = {}

    def start(run):
        killer["it"] = BroadcastKiller(run)
        return killer["it"]

    run, history, printed = fit(async_model, tmp_path / "run", extra, helper=start)
    assert killer["it"].killed, printed  # it was killed mid-broadcast
    assert len(history) == steps  # the run went on: the group re-formed, or a fallback
    rollouts = run.trainer.rollouts
    events = [e["event"] for e in rollouts.events]
    assert events[0] == "lost", printed  # a new replica may join, or the run end first
    assert any("lost" in line and "training goes on" in line for line in printed)
    assert sum(row["async/weight_broadcast_bytes"] for row in history) > 0
    ledger = run.trainer.queue.ledger
    assert ledger.count(0) == steps * 2  # every prompt of the batches, once


@pytest.mark.slow
def test_broadcasts_that_cannot_complete_fall_back_to_the_object_store(
    ray_local, async_model, tmp_path
):
    from test_async_training import EXACT, fit

    # a bound no group can form within: every publish misses, on both ends
    extra = [
        *EXACT,
        "trainer.total_training_steps=2",
        "trainer.resume_mode=disable",
        "async_training.weight_transport=collective",
        "async_training.weight_sync_timeout_s=0.001",
    ]
    run, history, printed = fit(async_model, tmp_path / "run", extra)
    assert len(history) == 2  # the run went on with the object store's copy
    assert sum(row["async/weight_transport_fallbacks"] for row in history) >= 1
    assert any("by the object store" in line or "missed the broadcast" in line for line in printed)
    assert all(row["async/staleness/max"] == 0 for row in history)
    assert run.trainer.queue.ledger.count(0) == 4
