"""The on-policy shortcut (`rayrl.trainer.on_policy`): with one PPO epoch over one
mini-batch the actor update's own log-probs replace the separate old-log-prob pass,
bitwise equal to it on CPU; whatever reads old log-probs before the update keeps it."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from rayrl.batch import Batch
from rayrl.models import build_tiny_model
from rayrl.train import packing
from rayrl.trainer.metrics import rollout_probs_diff
from rayrl.trainer.on_policy import separate_pass_reason
from rayrl.workers import ActorRolloutRefWorker
from rayrl.workers import actor as actor_module
from workers_cases import config, generate, local_worker, prompts, update_actor

# 4 prompts x 2 samples: one mini-batch of 8; the passes split it differently
# (log-probs 3 rows at a time, the update 4), so the packed rows differ too.
SIZES = [
    "data.train_batch_size=4",
    "data.max_response_length=8",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=3",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("onp") / "m", layers=2, hidden=32))


def _recording(monkeypatch):
    """Wrap the actor's loss so that it keeps each micro-batch's detached log-probs."""
    seen, factory = {}, actor_module.actor_loss_fn

    def recording_factory(*args, **kwargs):
        loss_fn = factory(*args, **kwargs)

        def record(outputs, mb):
            log_probs = outputs["log_probs"].detach()
            for row, values in zip(mb["row"].tolist(), log_probs, strict=True):
                seen[row] = values.clone()
            return loss_fn(outputs, mb)

        return record

    monkeypatch.setattr(actor_module, "actor_loss_fn", recording_factory)
    return seen


@pytest.mark.parametrize("packed", [True, False])
def test_the_update_log_probs_are_the_separate_pass_bitwise_and_train_alike(
    model_dir, packed, monkeypatch
):
    if packed:  # rows with so little padding run padded on a CPU unless told otherwise
        monkeypatch.setattr(packing, "CPU_MIN_PADDING_TO_PACK", 0.0)
    cfg = config(*SIZES)
    assert separate_pass_reason(cfg, 8) is None
    separate = local_worker(ActorRolloutRefWorker, config=cfg, model_path=model_dir)
    shortcut = local_worker(ActorRolloutRefWorker, config=cfg, model_path=model_dir)
    batch = generate(separate, prompts(AutoTokenizer.from_pretrained(model_dir), 4))
    batch["advantages"] = torch.randn(
        batch["responses"].shape, generator=torch.Generator().manual_seed(0)
    )
    batch["row"] = torch.arange(len(batch))
    batch = batch.union(separate.compute_ref_log_prob(batch))
    old = separate.compute_log_prob(batch)["old_log_probs"]

    seen = _recording(monkeypatch)
    got = update_actor(shortcut, batch.select(*batch.keys()), on_policy=True)
    used = torch.stack([seen[row] for row in range(len(batch))])
    assert torch.equal(used, old), (used - old).abs().max()  # bitwise, same weights

    want = update_actor(separate, batch.union(Batch({"old_log_probs": old})))
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/ppo_kl"):
        assert got[key] == want[key], key
    assert got["actor/pg_clipfrac"] == want["actor/pg_clipfrac"] == 0.0
    assert "actor/entropy" in got  # reported by the update's forward now
    for a, b in zip(
        shortcut.actor.model.parameters(), separate.actor.model.parameters(), strict=True
    ):
        assert torch.equal(a, b)


def test_an_on_policy_update_of_several_mini_batches_is_refused(model_dir):
    cfg = config(*SIZES, "actor_rollout_ref.actor.ppo_mini_batch_size=2")
    worker = local_worker(ActorRolloutRefWorker, config=cfg, model_path=model_dir)
    batch = generate(worker, prompts(AutoTokenizer.from_pretrained(model_dir), 4))
    batch["advantages"] = torch.zeros(batch["responses"].shape)
    with pytest.raises(ValueError, match="one PPO epoch over one mini-batch"):
        update_actor(worker, batch, on_policy=True)


@pytest.mark.parametrize(
    "overrides, reason",
    [
        (["actor_rollout_ref.actor.ppo_epochs=2"], "2 PPO epochs"),
        (["actor_rollout_ref.actor.ppo_mini_batch_size=2"], "several mini-batches"),
        (["algorithm.use_kl_in_reward=true"], "KL penalty in the reward"),
        (
            [
                "algorithm.rollout_correction.rollout_is=token",
                "algorithm.rollout_correction.rollout_is_batch_normalize=true",
            ],
            "normalises its weights",
        ),
        (["algorithm.rollout_correction.rollout_rs=token_k1"], "rejection sampling"),
        (
            ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=score"],
            "dynamic sampling",
        ),
        (
            [
                "algorithm.adv_estimator=gae",
                "critic.ppo_mini_batch_size=4",
                "critic.ppo_micro_batch_size_per_gpu=4",
            ],
            "critic",
        ),
    ],
)
def test_what_reads_old_log_probs_before_the_update_keeps_the_separate_pass(overrides, reason):
    assert reason in separate_pass_reason(config(*SIZES, *overrides), 8)


def test_truncated_is_weights_need_no_separate_pass_and_report_the_same(model_dir, monkeypatch):
    """Token-level truncated importance weights (async's default correction) on the
    update's own log-probs: the same loss, weights and verl's probs-diff metrics as the
    separate pass gives, from rollout log-probs of an older policy (perturbed here)."""
    monkeypatch.setattr(packing, "CPU_MIN_PADDING_TO_PACK", 0.0)
    cfg = config(
        *SIZES,
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "algorithm.rollout_correction.rollout_is=token",
        "algorithm.rollout_correction.rollout_is_threshold=1.5",
    )
    assert separate_pass_reason(cfg, 8) is None
    separate = local_worker(ActorRolloutRefWorker, config=cfg, model_path=model_dir)
    shortcut = local_worker(ActorRolloutRefWorker, config=cfg, model_path=model_dir)
    batch = generate(separate, prompts(AutoTokenizer.from_pretrained(model_dir), 4))
    noise = torch.randn(batch["responses"].shape, generator=torch.Generator().manual_seed(1))
    batch["rollout_log_probs"] = batch["rollout_log_probs"] + 0.5 * noise
    batch["advantages"] = torch.randn(
        batch["responses"].shape, generator=torch.Generator().manual_seed(0)
    )
    batch = batch.union(separate.compute_ref_log_prob(batch))
    old = separate.compute_log_prob(batch)
    want_diff = rollout_probs_diff(old, batch)  # what the trainer reports after the pass

    got = update_actor(shortcut, batch.select(*batch.keys()), on_policy=True)
    want = update_actor(separate, batch.union(old.select("old_log_probs")))
    assert want["actor/tis_clipfrac"] > 0.05  # the cap bites: the weights matter
    for key in (
        "actor/pg_loss",
        "actor/grad_norm",
        "actor/tis_weight_mean",
        "actor/tis_clipfrac",
    ):
        assert got[key] == want[key], key
    assert "training/rollout_probs_diff_max" not in want  # the pass reports them, not the update
    for key, value in want_diff.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_an_estimator_that_reads_old_log_probs_keeps_the_separate_pass():
    cfg = config(
        *SIZES,
        "algorithm.adv_estimator=optimal_token_baseline",
        "actor_rollout_ref.actor.calculate_sum_pi_squared=true",
    )
    assert "estimator optimal_token_baseline reads them" in separate_pass_reason(cfg, 8)


def test_sum_pi_squared_keeps_the_separate_pass_whatever_the_estimator():
    """Only the log-prob pass returns it (verl's variance_proxy/* metrics read it)."""
    cfg = config(*SIZES, "actor_rollout_ref.actor.calculate_sum_pi_squared=true")
    assert "sum_pi_squared" in separate_pass_reason(cfg, 8)
