"""The one path that forms process groups, with the real roles: the colocated actor
(rollout and reference inside) and critic, sharded over two ranks on gloo.

An init that kills its worker is retried by re-forming the group; a replaced rank and
a rebuilt survivor, restored from a step-start snapshot, compute what they computed
before (after the next snapshot reused the host buffers it was captured in), and an
update replayed from it lands bitwise where the first one did."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from rayrl.controller import GroupSnapshot, colocate
from rayrl.models import build_tiny_model
from rayrl.testing.faults import Fault, inject
from rayrl.workers import ActorRolloutRefWorker, CriticWorker
from workers_cases import (
    close,
    config,
    forced_batch,
    group_on,
    prompts,
    update_actor,
    update_critic,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("roles") / "m", layers=1, hidden=32))


def test_init_retry_replacement_and_snapshots_with_the_real_roles(ray_local, model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = config(
        "algorithm.adv_estimator=gae", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"
    )
    fused = colocate({"actor": ActorRolloutRefWorker, "critic": CriticWorker})
    group, pool, kv = group_on(fused, 2, "hybrid")
    try:
        inject(group, Fault("init_worker", "kill", ranks=(1,)))  # this process dies in init
        first_pid = group.describe(1).pid
        group.init(
            timeout_s=300,
            retries=1,
            backend="gloo",
            pg_timeout_s=120,
            actor={"config": cfg, "model_path": model_dir},
            critic={"config": cfg, "model_path": model_dir},
        )
        assert group.generation == 1 and group.describe(1).pid != first_pid
        actor, critic = group.view("actor"), group.view("critic")
        assert [i["sharded"] for i in actor.device_info()] == [True, True]

        batch = forced_batch(prompts(tok, 2).repeat(2), 77, 6)
        batch.meta["step"] = 0
        batch = batch.union(actor.compute_log_prob(batch).select("old_log_probs"))
        batch = batch.union(actor.compute_ref_log_prob(batch))  # the reference role
        batch["advantages"] = torch.ones(4, 6)
        batch["returns"] = torch.ones(4, 6)
        batch = batch.union(critic.compute_values(batch))
        snap = GroupSnapshot.take(group)
        update_actor(actor, batch)
        update_critic(critic, batch)
        after = (
            actor.compute_log_prob(batch)["old_log_probs"],
            critic.compute_values(batch)["values"],
        )
        # the next boundary's capture reuses the host buffers `snap` was copied out of
        GroupSnapshot.take(group, previous=snap)

        done = group.replace(0)  # rank 0 anew, rank 1 rebuilds on generation 2
        assert done.new_pid != done.old_pid and group.generation == 2
        snap.restore(group)
        assert torch.equal(actor.compute_log_prob(batch)["old_log_probs"], batch["old_log_probs"])
        assert torch.equal(actor.compute_ref_log_prob(batch)["ref_log_prob"], batch["ref_log_prob"])
        assert torch.equal(critic.compute_values(batch)["values"], batch["values"])
        update_actor(actor, batch)  # the same update again, from the same state
        update_critic(critic, batch)
        assert torch.equal(actor.compute_log_prob(batch)["old_log_probs"], after[0])
        assert torch.equal(critic.compute_values(batch)["values"], after[1])
    finally:
        close(group, pool, kv)
