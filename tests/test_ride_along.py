"""Stages riding on the generate call (`rayrl.trainer.ride_along`): in a one-process run
the reward's scores and the reference log-probs come back with the samples, equal to
what the separate calls compute, and the product path makes no separate calls."""

from __future__ import annotations

import math

import pytest
from transformers import AutoTokenizer

from rayrl.batch_equal import tensors_equal
from rayrl.config import load_config
from rayrl.models import build_tiny_model
from rayrl.rewards.items import summarize
from rayrl.trainer.ppo import PPOTrainer
from rayrl.trainer.ride_along import Riding, riding_stages
from rayrl.trainer.run import Run
from rayrl.workers import ActorRolloutRefWorker, RewardWorker
from rayrl.workers.actor import GEN_PARTS
from rayrl.workers.context import StepContext
from rayrl.workers.reward import rewards_from_batch
from workers_cases import config, local_worker, prompts

BOTH = Riding(scores=True, ref=True)


@pytest.mark.parametrize(
    ("overrides", "ranks", "reward_in_actor", "use_ref", "flags"),
    [
        ([], 1, True, True, BOTH),
        ([], 2, True, True, Riding()),  # several ranks: the batch is re-balanced in between
        ([], 1, False, True, Riding(ref=True)),  # the reward scores in its own process
        ([], 1, True, False, Riding(scores=True)),
        (["reward.http.url=http://localhost:1/score"], 1, True, True, Riding(ref=True)),
        (
            ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc"],
            1,
            True,
            True,
            Riding(ref=True),
        ),
    ],
)
def test_what_rides_on_generate(overrides, ranks, reward_in_actor, use_ref, flags):
    cfg = load_config("grpo", overrides)
    assert riding_stages(cfg, ranks, reward_in_actor, use_ref) == flags


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("ride") / "m", layers=2, hidden=32))


def test_riding_columns_equal_the_separate_calls_bitwise(model_dir):
    cfg = config("reward.num_workers=1")
    actor = local_worker(ActorRolloutRefWorker, config=cfg, model_path=model_dir)
    reward = local_worker(RewardWorker, config=cfg, tokenizer_path=model_dir)
    actor.peers = {"actor": actor, "reward": reward}  # as a fused process holds them
    batch = prompts(AutoTokenizer.from_pretrained(model_dir), 4)
    meta = dict(batch.meta)
    plain = actor.generate(batch, StepContext()).batch
    result = actor.generate(batch, StepContext(with_scores=True, with_ref=True))
    riding, timing = result.batch, result.timing
    # the riding stages, beside the weight sync and the generation's own parts
    assert set(timing) - set(GEN_PARTS) == {"weight_sync", "reward", "ref"}
    assert {"rollout_wake", "rollout_sleep"} <= set(timing)  # free_cache_engine: verl's default
    assert timing["reward"] > 0 and timing["ref"] > 0
    assert riding.meta == plain.meta and batch.meta == meta  # options never enter the meta
    separate = plain.union(reward.compute_score(plain)).union(actor.compute_ref_log_prob(plain))
    assert set(riding.keys()) == set(separate.keys())
    timed = "reward_elapsed_s"  # the scoring's own time differs, nothing else
    for key in riding.tensors:
        if key != timed:
            assert tensors_equal(riding[key], separate[key]), key
    assert list(riding["reward_extra"]) == list(separate["reward_extra"])
    ours, theirs = (summarize(rewards_from_batch(b)) for b in (riding, separate))
    assert ours.keys() == theirs.keys() and "elapsed_s/mean" in ours
    assert {k: v for k, v in ours.items() if k != "elapsed_s/mean"} == {
        k: v for k, v in theirs.items() if k != "elapsed_s/mean"
    }
    with pytest.raises(RuntimeError, match="no reward role runs in this process"):
        local_worker(ActorRolloutRefWorker, config=cfg, model_path=model_dir).generate(
            batch, StepContext(with_scores=True)
        )


@pytest.mark.slow
def test_a_one_process_run_makes_no_separate_reward_or_ref_call(ray_local, tmp_path):
    cfg = load_config(
        "grpo",
        [
            "data.train_batch_size=2",
            "data.max_response_length=8",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "trainer.total_training_steps=1",
            "trainer.device=cpu",
            "trainer.val_before_train=false",
            "trainer.export_hf=false",
            "resources.dashboard=false",
            f"trainer.output_dir={tmp_path}",
        ],
    )
    run = Run(PPOTrainer(cfg))
    try:
        [metrics] = run.setup().fit()
    finally:
        run.shutdown()
    assert {stage for stage, _ in run.calls.kept} == {"gen", "update_actor"}
    assert run.trainer.riding == BOTH
    for key in ("timing_s/gen", "timing_s/ref", "timing_s/reward", "reward/score/mean"):
        assert math.isfinite(metrics[key]) and metrics[key] >= 0, key
    assert metrics["timing_s/ref"] > 0 and metrics["timing_s/reward"] > 0
    # the KV cache given back after the generation: a part of timing_s/gen, not beside it
    parts = [metrics[f"timing_s/{k}"] for k in GEN_PARTS if f"timing_s/{k}" in metrics]
    assert "timing_s/rollout_sleep" in metrics and metrics["timing_s/gen"] >= sum(parts)
