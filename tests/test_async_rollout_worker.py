"""The rollout replica's weight versions, in process with a tiny model: a policy that
arrives mid-call is swapped in between engine steps (partial rollouts: each token keeps
the version that sampled it), or leaves the call on its own version, or aborts a call
that could no longer train; packed weights round-trip exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rayrl.batch import Batch
from rayrl.config import load_config
from rayrl.models import build_tiny_model
from rayrl.train.weight_sync import pack_buckets, unpack_bucket
from rayrl.workers.rollout import ReplicaCall, RolloutWorker

R = 6


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("replica-model") / "tiny"
    return str(build_tiny_model(out, layers=2, hidden=64, seed=3, overwrite=True))


def replica(model: str) -> RolloutWorker:
    cfg = load_config(
        "grpo",
        [
            f"actor_rollout_ref.model.path={model}",
            "trainer.device=cpu",
            f"data.max_response_length={R}",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.rollout.ignore_eos=true",
        ],
    )
    worker = RolloutWorker()
    worker.init_worker(cfg, model)
    return worker


def prompts() -> Batch:
    ids = torch.tensor([[5, 6, 7, 8], [0, 9, 10, 11]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    return Batch({"input_ids": ids, "attention_mask": mask}, {"uid": np.array(["a", "b"], object)})


def new_policy(worker: RolloutWorker) -> list:
    """Another policy's packed weights: every parameter scaled."""
    params = worker.engine.model.named_parameters()
    return list(pack_buckets(((n, p.detach() * 1.7) for n, p in params), bucket_bytes=1 << 16))


def arrives_after_first_token(worker: RolloutWorker, version: int, buckets: list) -> None:
    """Make policy `version` arrive (as `offer_weights` stages it) once the call's first
    engine step drew its first tokens: the service's next look for new weights, before
    the second step, finds it."""
    engine = worker.service.engine
    real = engine.step
    state = {"steps": 0}

    def step():
        events = real()
        state["steps"] += 1
        if state["steps"] == 1:
            weights = (pair for bucket in buckets for pair in unpack_bucket(bucket))
            worker.service.offer(version, weights)
        return events

    engine.step = step


def test_packed_weights_round_trip_exactly(model):
    worker = replica(model)
    params = dict(worker.engine.model.named_parameters())
    buckets = list(pack_buckets(params.items(), bucket_bytes=1 << 12))
    assert len(buckets) > 1
    back = dict(pair for bucket in buckets for pair in unpack_bucket(bucket))
    assert back.keys() == params.keys()
    assert all(torch.equal(back[k], params[k]) for k in params)


def test_partial_rollout_swaps_mid_call_and_tags_each_token(model):
    worker = replica(model)
    before = worker.generate(prompts(), ReplicaCall(step=3))
    assert before.versions.unique().tolist() == [0]
    arrives_after_first_token(worker, 1, new_policy(worker))
    mixed = worker.generate(prompts(), ReplicaCall(step=3, partial_rollout=True))
    assert (mixed.first_version, mixed.last_version) == (0, 1) and not mixed.aborted
    assert mixed.versions[:, 0].unique().tolist() == [0]
    assert mixed.versions[:, 1:].unique().tolist() == [1]
    # the first tokens came from the old policy (same seeds: the same tokens), the rest not
    responses, old = mixed.batch["responses"], before.batch["responses"]
    assert torch.equal(responses[:, 0], old[:, 0])
    assert not torch.equal(responses, old)
    assert worker.version == 1


def test_without_partial_rollouts_a_call_keeps_its_version_or_aborts(model):
    worker = replica(model)
    before = worker.generate(prompts(), ReplicaCall(step=0))
    buckets = new_policy(worker)
    arrives_after_first_token(worker, 1, buckets)
    kept = worker.generate(prompts(), ReplicaCall(step=0, max_lag=1))  # still trainable
    assert kept.versions.unique().tolist() == [0]
    assert torch.equal(kept.batch["responses"], before.batch["responses"])
    later = worker.generate(prompts(), ReplicaCall(step=0, max_lag=1))  # swapped at its start
    assert later.versions.unique().tolist() == [1] and worker.version == 1
    arrives_after_first_token(worker, 3, buckets)  # 3 - 1 > max_lag: no longer trainable
    aborted = worker.generate(prompts(), ReplicaCall(step=0, max_lag=1))
    assert aborted.aborted and aborted.batch is None
    assert worker.version == 3  # nothing pins the old version now: the new one is in
