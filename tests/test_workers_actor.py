"""ActorRolloutRef on real Ray: generation, log-probs, reference, updates, hybrid engine."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from rayrl.models import build_tiny_model
from rayrl.workers import ActorRolloutRefWorker
from workers_cases import close, config, forced_batch, generate, group_on, prompts, update_actor

TOKEN = 77


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("actor") / "m", layers=1, hidden=32))


def test_hybrid_actor_generates_updates_and_generates_with_new_weights(ray_local, model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = config(
        "actor_rollout_ref.actor.policy_loss.loss_mode=reinforce",
        "actor_rollout_ref.actor.optim.lr=0.05",
        "actor_rollout_ref.actor.ppo_epochs=6",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.actor.fsdp_config.param_offload=true",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
    )
    group, pool, kv = group_on(ActorRolloutRefWorker, 1, "actor")
    try:
        group.init(timeout_s=300, config=cfg, model_path=model_dir)
        out = generate(group, prompts(tok, 2))
        assert len(out) == 4 and out["responses"].shape == (4, 6)
        assert list(out["sample_uid"]) == ["p0/0", "p0/1", "p1/0", "p1/1"]
        old = group.compute_log_prob(out)
        ref = group.compute_ref_log_prob(out)
        mask = out["response_mask"].bool()
        # Same weights before any update: policy == reference == what the rollout saw.
        torch.testing.assert_close(old["old_log_probs"][mask], ref["ref_log_prob"][mask])
        torch.testing.assert_close(
            old["old_log_probs"][mask], out["rollout_log_probs"][mask], atol=1e-4, rtol=1e-4
        )
        greedy = generate(group, prompts(tok, 2), "validate")
        assert not (greedy["responses"] == TOKEN).all()

        train = forced_batch(prompts(tok, 2).repeat(2), TOKEN, 6)
        train = train.union(group.compute_log_prob(train).select("old_log_probs"))
        train["advantages"] = torch.ones(4, 6)
        metrics = update_actor(group, train)
        assert metrics["actor/skipped"] == 0 and metrics["actor/grad_norm"] > 0
        assert metrics["perf/tflops/actor"] > 0 and "perf/mfu/actor" not in metrics  # CPU

        greedy = generate(group, prompts(tok, 2, step=1), "validate")
        assert (greedy["responses"] == TOKEN).all(), greedy["responses"]
        info = group.device_info()[0]
        assert info["sharded"] is False
        assert info["param_offload"] and info["optimizer_offload"]  # the config keys reach it
        assert not info["rollout_owns_copy"] and info["rollout_dtype"] == "float32"  # CPU
        assert info["rollout_cache"] == "dynamic"  # no static cache re-sized every step
    finally:
        close(group, pool, kv)


@pytest.mark.slow  # ~13 s on a loaded 2-core machine
def test_actor_with_the_native_rollout_engine(ray_local, model_dir):
    """rollout.name=native: the engine owns a copy, filled from the actor's load by the
    first weight sync (not read from disk) and refreshed after updates; its KV cache is
    released between generations (free_cache_engine)."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = config(
        "actor_rollout_ref.rollout.name=native",
        "actor_rollout_ref.rollout.max_num_seqs=3",  # fewer slots than samples
        "actor_rollout_ref.actor.policy_loss.loss_mode=reinforce",
        "actor_rollout_ref.actor.optim.lr=0.05",
        "actor_rollout_ref.actor.ppo_epochs=6",
        "actor_rollout_ref.actor.use_kl_loss=false",
    )
    group, pool, kv = group_on(ActorRolloutRefWorker, 1, "actor")
    try:
        group.init(timeout_s=300, config=cfg, model_path=model_dir)
        info = group.device_info()[0]
        assert info["rollout"] == "NativeRolloutEngine" and info["rollout_asleep"]
        assert info["rollout_weights_unset"] > 0  # not read from disk: the sync fills them
        out = generate(group, prompts(tok, 2))
        assert group.device_info()[0]["rollout_weights_unset"] == 0
        assert len(out) == 4 and out["responses"].shape == (4, 6)
        old = group.compute_log_prob(out)
        mask = out["response_mask"].bool()
        torch.testing.assert_close(
            old["old_log_probs"][mask], out["rollout_log_probs"][mask], atol=1e-4, rtol=1e-4
        )
        train = forced_batch(prompts(tok, 2).repeat(2), TOKEN, 6)
        train = train.union(group.compute_log_prob(train).select("old_log_probs"))
        train["advantages"] = torch.ones(4, 6)
        assert update_actor(group, train)["actor/skipped"] == 0
        greedy = generate(group, prompts(tok, 2, step=1), "validate")
        assert (greedy["responses"] == TOKEN).all(), greedy["responses"]
    finally:
        close(group, pool, kv)


@pytest.mark.slow
def test_sharded_actor_syncs_gathered_weights_into_its_rollout_copy(ray_local, model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = config("trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.optim.lr=0.01")
    group, pool, kv = group_on(ActorRolloutRefWorker, 2, "actor")
    try:  # the group forms the ranks' process group, then the roles build their engines
        group.init(timeout_s=300, backend="gloo", config=cfg, model_path=model_dir)
        assert all(i["sharded"] for i in group.device_info())
        out = generate(group, prompts(tok, 2))
        out = out.union(group.compute_log_prob(out)).union(group.compute_ref_log_prob(out))
        out["advantages"] = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
        metrics = update_actor(group, out.select(*[k for k in out.tensors if k != "entropy"]))
        assert metrics["actor/skipped"] == 0
        after = generate(group, prompts(tok, 2, step=1))
        new = group.compute_log_prob(after)
        mask = after["response_mask"].bool()
        # The rollout copy now holds the updated (gathered) weights.
        torch.testing.assert_close(
            new["old_log_probs"][mask], after["rollout_log_probs"][mask], atol=1e-4, rtol=1e-4
        )
        ref = group.compute_ref_log_prob(after)
        assert not torch.allclose(new["old_log_probs"][mask], ref["ref_log_prob"][mask])
    finally:
        close(group, pool, kv)


@pytest.mark.slow
def test_two_ranks_as_one_sequence_parallel_group_and_one_tensor_parallel_replica(
    ray_local, model_dir
):
    """Two actor ranks with `ulysses_sequence_parallel_size=2` and a native rollout of
    `tensor_model_parallel_size=2`: both layouts make the ranks one part (the same rows
    to each, one output taken), and generation, log-probs and an update go through."""
    from rayrl.trainer.roles import set_data_layouts

    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = config(
        "trainer.n_gpus_per_node=2",
        "actor_rollout_ref.actor.optim.lr=0.01",
        "actor_rollout_ref.model.use_remove_padding=true",
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
        "actor_rollout_ref.rollout.name=native",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    )
    group, pool, kv = group_on(ActorRolloutRefWorker, 2, "actor")
    try:
        group.init(timeout_s=300, backend="gloo", config=cfg, model_path=model_dir)
        set_data_layouts(group, [group])
        assert {name: layout.part_of for name, layout in group.data_layouts.items()} == {
            "train": (0, 0),
            "ref": (0, 0),
            "rollout": (0, 0),
        }
        out = generate(group, prompts(tok, 2))
        assert len(out) == 4  # one replica's output, not one per rank
        old = group.compute_log_prob(out)
        mask = out["response_mask"].bool()
        torch.testing.assert_close(
            old["old_log_probs"][mask], out["rollout_log_probs"][mask], atol=1e-4, rtol=1e-4
        )
        out = out.union(old.select("old_log_probs")).union(group.compute_ref_log_prob(out))
        out["advantages"] = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
        assert update_actor(group, out)["actor/skipped"] == 0
        after = generate(group, prompts(tok, 2, step=1))  # the TP parts of the new weights
        new = group.compute_log_prob(after)["old_log_probs"]
        mask = after["response_mask"].bool()
        torch.testing.assert_close(
            new[mask], after["rollout_log_probs"][mask], atol=1e-4, rtol=1e-4
        )
    finally:
        close(group, pool, kv)
