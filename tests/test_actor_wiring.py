"""The actor's wiring between the algorithms and the training engine, checked against
hand computations: the loss formula (entropy-bonus and KL signs), metrics that do not
depend on the micro-batch size, optimizer steps per RL step, the LR schedule over RL
steps, and the sampling temperature in training-side log-probs."""

from __future__ import annotations

import pytest
import torch

from engine_cases import ragged_batch, tiny_model_dir  # noqa: F401 (fixture)
from rayrl.batch import Batch
from rayrl.config import load_config
from rayrl.train.engine import TrainEngine
from rayrl.workers import ActorRolloutRefWorker
from rayrl.workers.context import StepContext
from rayrl.workers.losses import actor_loss_fn
from workers_cases import local_worker

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _actor_cfg(*overrides: str):
    return load_config(
        "grpo",
        [
            "data.train_batch_size=2",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.actor.use_kl_loss=false",
            *overrides,
        ],
    )


def test_actor_loss_is_pg_minus_entropy_bonus_plus_kl():
    cfg = _actor_cfg(
        "actor_rollout_ref.actor.entropy_coeff=0.3",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_coef=0.5",
        "actor_rollout_ref.actor.kl_loss_type=k1",
    ).actor_rollout_ref.actor
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    log_probs = -torch.rand(2, 4, generator=g) - 0.1
    mb = Batch.from_dict(
        {
            "response_mask": mask,
            "old_log_probs": log_probs.clone(),  # ratio 1: no clipping
            "advantages": torch.randn(2, 4, generator=g),
            "ref_log_prob": log_probs - 0.2,
        }
    )
    entropy = torch.rand(2, 4, generator=g)
    loss, metrics = actor_loss_fn(cfg)({"log_probs": log_probs, "entropy": entropy}, mb)
    real = mask.bool()
    pg = -mb["advantages"][real].mean()
    hand = pg - 0.3 * entropy[real].mean() + 0.5 * 0.2
    assert float(loss) == pytest.approx(float(hand), abs=1e-6)
    assert metrics["actor/pg_loss"] == pytest.approx(float(pg), abs=1e-6)
    assert metrics["actor/entropy"] == pytest.approx(float(entropy[real].mean()), abs=1e-6)
    assert metrics["actor/kl_loss"] == pytest.approx(0.2, abs=1e-6)


def test_loss_metrics_do_not_depend_on_the_micro_batch_size(tiny_model_dir):  # noqa: F811
    cfg = _actor_cfg(
        "actor_rollout_ref.actor.entropy_coeff=0.01", "actor_rollout_ref.actor.use_kl_loss=true"
    ).actor_rollout_ref.actor
    batch = ragged_batch(8, seed=3)
    batch["old_log_probs"] = TrainEngine(tiny_model_dir).forward(batch)["log_probs"] + 0.05
    batch["ref_log_prob"] = batch["old_log_probs"] - 0.1
    runs = {}
    for micro in (8, 4, 1):
        engine = TrainEngine(tiny_model_dir, optim={"lr": 1e-3})
        runs[micro] = engine.train_step(
            batch, actor_loss_fn(cfg), micro_batch_size=micro, with_entropy=True
        )
    for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/ppo_kl"):
        for micro in (4, 1):
            assert runs[micro][key] == pytest.approx(runs[8][key], rel=1e-4, abs=1e-7), key
    assert runs[1]["actor/pg_loss"] == pytest.approx(
        runs[1]["loss"] + 0.01 * runs[1]["actor/entropy"] - 0.001 * runs[1]["actor/kl_loss"],
        rel=1e-4,
    )


def _update_batch(worker: ActorRolloutRefWorker, rows: int = 4) -> Batch:
    batch = ragged_batch(rows, seed=5)
    batch.meta["step"] = 0
    batch["old_log_probs"] = worker.compute_log_prob(batch)["old_log_probs"]
    return batch


def test_update_actor_steps_per_prompt_mini_batch_and_lr_per_rl_step(tiny_model_dir):  # noqa: F811
    # 2 prompts x n=2 samples; mini-batch of 1 prompt = 2 samples; 2 epochs: 4 optimizer
    # steps per RL step; a cosine schedule over 2 RL steps is at half the peak on step 2.
    cfg = _actor_cfg(
        "actor_rollout_ref.actor.ppo_epochs=2",
        "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine",
        "actor_rollout_ref.actor.optim.lr=0.01",
    )
    worker = local_worker(
        ActorRolloutRefWorker,
        config=cfg,
        model_path=str(tiny_model_dir),
        total_steps=2,
        with_ref=False,
    )
    batch = _update_batch(worker)
    first = worker.update_actor(batch, StepContext(step=0))
    assert worker.actor.optimizer_steps == 4
    second = worker.update_actor(batch, StepContext(step=1))
    assert worker.actor.optimizer_steps == 8
    assert first["actor/lr"] == pytest.approx(0.01)
    assert second["actor/lr"] == pytest.approx(0.005)
    assert worker.actor.scheduler.last_epoch == 2


def _hand_log_probs(model, batch: Batch, temperature: float) -> torch.Tensor:
    """Per response token: log softmax(logits / T) of the unpadded sequence, by hand."""
    resp_len = batch["responses"].shape[1]
    out = torch.zeros(batch["responses"].shape)
    for i in range(len(batch)):
        ids = batch["input_ids"][i][batch["attention_mask"][i].bool()]
        n_resp = int(batch["response_mask"][i].sum())
        with torch.no_grad():
            logits = model(ids[None]).logits[0].double()
        logp = torch.log_softmax(logits / temperature, dim=-1)
        start = len(ids) - n_resp
        for t in range(n_resp):
            out[i, t] = logp[start + t - 1, ids[start + t]]
    assert out.shape[1] == resp_len
    return out


def test_training_log_probs_use_the_rollout_temperature(tiny_model_dir):  # noqa: F811
    cfg = _actor_cfg("actor_rollout_ref.rollout.temperature=0.7")
    worker = local_worker(
        ActorRolloutRefWorker, config=cfg, model_path=str(tiny_model_dir), with_ref=False
    )
    batch = ragged_batch(4, seed=7)
    got = worker.compute_log_prob(batch)["old_log_probs"]
    hand = _hand_log_probs(worker.actor.model, batch, 0.7)
    torch.testing.assert_close(got, hand.float(), atol=2e-5, rtol=0)
    assert not torch.allclose(got, _hand_log_probs(worker.actor.model, batch, 1.0).float())


def test_the_actor_loss_reads_its_own_clip_bounds_and_the_old_log_probs():
    """Clip-higher as configured (0.2 below, 0.28 above: not swapped), and the ratio
    taken against the old log-probs it is given (not against itself, ratio 1)."""
    import math

    cfg = _actor_cfg(
        "actor_rollout_ref.actor.clip_ratio_low=0.2",
        "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "actor_rollout_ref.actor.entropy_coeff=0",
    ).actor_rollout_ref.actor
    ratios = torch.tensor([[1.25, 1.5, 0.5]], dtype=torch.float64)
    mb = Batch.from_dict(
        {
            "response_mask": torch.ones(1, 3),
            "old_log_probs": torch.zeros(1, 3, dtype=torch.float64),
            "advantages": torch.tensor([[1.0, 1.0, -1.0]], dtype=torch.float64),
        }
    )
    loss, _ = actor_loss_fn(cfg)({"log_probs": ratios.log()}, mb)
    # -min(r A, clip(r, 0.8, 1.28) A) per token: -1.25, -1.28, +0.8; token mean
    assert float(loss) == pytest.approx((-1.25 - 1.28 + 0.8) / 3, abs=1e-9)
    on_policy, _ = actor_loss_fn(cfg, on_policy=True)({"log_probs": ratios.log()}, mb)
    assert float(on_policy) == pytest.approx(-1 / 3, abs=1e-9)  # ratio 1: -mean(A)
    assert not math.isclose(float(loss), float(on_policy))
