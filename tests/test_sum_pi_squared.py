"""Each response token's sum over the vocabulary of its squared probabilities
(`sum_pi_squared`, `actor.calculate_sum_pi_squared`): the fused head, the logits path and
the worker's log-prob pass give ``sum(softmax(z / T)^2)`` of the model's own logits,
padded and packed; the optimal token baseline reads it through the advantage stage; the
trainer keeps the separate log-prob pass for it. (Ulysses: `test_engine_ulysses`.)"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine_cases import ragged_batch, tiny_model_dir  # noqa: F401 (fixture)
from rayrl.algos import optimal_token_baseline_advantages
from rayrl.config import load_config
from rayrl.train.logprob_head import LogProbHead, install_logprob_head
from rayrl.train.outputs import response_outputs
from rayrl.trainer.advantage import AdvantageStage
from rayrl.trainer.ppo import PPOTrainer
from rayrl.trainer.run import Run
from rayrl.workers import ActorRolloutRefWorker
from workers_cases import config, generate, local_worker, prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

OTB = [
    "algorithm.adv_estimator=optimal_token_baseline",
    "actor_rollout_ref.actor.calculate_sum_pi_squared=true",
]


def direct_sum_pi_squared(model, batch, temperature: float) -> torch.Tensor:
    """``sum_v softmax(logits / T)_v^2`` at each response token, straight from the
    model's full ``[b, P + R, vocab]`` logits in float32 (0 on padding)."""
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        ).logits.float()
    width = batch["responses"].shape[1]
    prompt = batch["input_ids"].shape[1] - width
    before = logits[:, prompt - 1 : prompt - 1 + width]  # the logits that predict each token
    probs = torch.softmax(before / temperature, dim=-1)
    return torch.where(batch["response_mask"].bool(), (probs**2).sum(-1), 0.0)


@pytest.fixture(scope="module")
def models(tiny_model_dir):  # noqa: F811
    """The tiny causal LM as transformers loads it (logits), and with the fused head."""
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    fused = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    assert install_logprob_head(fused) is not None
    return {"logits": plain.eval(), "fused": fused.eval()}


def test_the_fused_head_returns_sum_pi_squared_without_a_gradient():
    torch.manual_seed(0)
    head = LogProbHead(16, 50, bias=True).double()
    h = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 50, (37,))
    with head.requested(labels, 0.7, with_entropy=True, chunk_size=8, with_sum_pi_squared=True):
        out = head(h)
    with head.requested(labels, 0.7, with_entropy=True, chunk_size=8):
        two = head(h)
    probs = torch.softmax(F.linear(h, head.weight, head.bias) / 0.7, dim=-1)
    assert out.shape == (37, 3) and two.shape == (37, 2)
    torch.testing.assert_close(out[:, 2], (probs**2).sum(-1))
    torch.testing.assert_close(out[:, :2], two)
    # the third column carries no gradient; the first two theirs, as without it
    (got,) = torch.autograd.grad(out.sum(), [h])
    (want,) = torch.autograd.grad(two.sum(), [h])
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("path", ["fused", "logits"])
@pytest.mark.parametrize("packed", [False, True])
def test_the_column_is_the_models_own_sum_of_squared_probabilities(models, path, packed):
    batch = ragged_batch(5, seed=2)
    model = models[path]
    for temperature in (1.0, 0.6):
        out = response_outputs(
            model,
            batch,
            packed=packed,
            with_entropy=True,
            temperature=temperature,
            chunk_size=7,
            with_sum_pi_squared=True,
        )
        want = direct_sum_pi_squared(models["logits"], batch, temperature)
        assert out["sum_pi_squared"].dtype == torch.float32
        torch.testing.assert_close(out["sum_pi_squared"], want, atol=2e-6, rtol=1e-4)
    plain = response_outputs(model, batch, packed=packed, with_entropy=True)
    assert "sum_pi_squared" not in plain


def test_a_changed_temperature_changes_the_column(models):
    batch = ragged_batch(4, seed=5)
    columns = [
        response_outputs(
            models["fused"], batch, packed=True, temperature=t, with_sum_pi_squared=True
        )["sum_pi_squared"]
        for t in (1.0, 0.5)
    ]
    real = batch["response_mask"].bool()
    # a colder softmax is more peaked: every real token's sum of squares grows
    assert bool((columns[1][real] > columns[0][real]).all())
    assert bool((columns[0][~real] == 0).all())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_compiled_bf16_head_on_cuda_gives_the_column(models, tiny_model_dir):  # noqa: F811
    """On a GPU the engine computes in bf16 with the head's chunk math compiled
    (`rayrl.train.regional_compile`): the column is the fp32 one to bf16's precision."""
    from rayrl.train.engine import TrainEngine

    engine = TrainEngine(tiny_model_dir, torch_compile=True, trainable=False)
    batch = ragged_batch(6, seed=3)
    out = engine.forward(batch, with_entropy=True, temperature=0.7, with_sum_pi_squared=True)
    want = direct_sum_pi_squared(models["logits"], batch, temperature=0.7)
    torch.testing.assert_close(out["sum_pi_squared"], want, atol=1e-4, rtol=3e-2)


@pytest.fixture(scope="module")
def pass_and_batch(tiny_model_dir):  # noqa: F811
    """A worker's samples and its log-prob pass under the optimal token baseline."""
    cfg = config(*OTB, "actor_rollout_ref.rollout.temperature=0.8")
    worker = local_worker(ActorRolloutRefWorker, config=cfg, model_path=str(tiny_model_dir))
    batch = generate(worker, prompts(AutoTokenizer.from_pretrained(tiny_model_dir), 4))
    return cfg, worker, batch, worker.compute_log_prob(batch)


def test_the_log_prob_pass_returns_the_column_at_the_log_prob_temperature(pass_and_batch, models):
    cfg, worker, batch, old = pass_and_batch
    column = old["sum_pi_squared"]
    assert column.shape == batch["responses"].shape and column.dtype == torch.float32
    want = direct_sum_pi_squared(models["logits"], batch, temperature=0.8)
    torch.testing.assert_close(column, want, atol=2e-6, rtol=1e-4)
    cfg.actor_rollout_ref.actor.calculate_sum_pi_squared = False
    try:
        assert "sum_pi_squared" not in worker.compute_log_prob(batch)
    finally:
        cfg.actor_rollout_ref.actor.calculate_sum_pi_squared = True


def test_the_advantages_are_the_estimator_on_the_passs_columns(pass_and_batch):
    cfg, _, batch, old = pass_and_batch
    batch = batch.union(old.select("old_log_probs", "sum_pi_squared"))
    n, width = batch["responses"].shape
    scores = torch.tensor([1.0, 0.0, 0.5, 2.0, 0.0, 1.0, 3.0, 1.0])[:n]
    token_scores = torch.zeros(n, width)
    lengths = batch["response_mask"].sum(-1)
    token_scores[torch.arange(n), lengths - 1] = scores
    batch["token_level_scores"] = token_scores
    uid = np.empty(n, dtype=object)
    uid[:] = [f"p{i // 2}" for i in range(n)]  # rollout.n=2: two samples of each prompt
    batch["uid"] = uid
    metrics = AdvantageStage(cfg)(batch)
    want, returns = optimal_token_baseline_advantages(
        token_scores, batch["response_mask"], uid, old["old_log_probs"], old["sum_pi_squared"]
    )
    torch.testing.assert_close(batch["advantages"], want)
    torch.testing.assert_close(batch["returns"], returns)
    assert metrics["critic/advantages/max"] > 0


@pytest.mark.slow
def test_a_grpo_step_with_the_optimal_token_baseline_runs_through_the_trainer(
    ray_local, tmp_path, monkeypatch
):
    """One step on real Ray: the log-prob pass runs (the shortcut is off), the trainer's
    advantages are the estimator on the step's own columns, and verl's variance_proxy/*
    metrics are reported from them."""
    seen = []
    stage_call = AdvantageStage.__call__

    def recording(stage, batch):
        metrics = stage_call(stage, batch)
        keys = ("token_level_rewards", "response_mask", "uid", "old_log_probs")
        seen.append(batch.select(*keys, "sum_pi_squared", "advantages").materialize())
        return metrics

    monkeypatch.setattr(AdvantageStage, "__call__", recording)
    cfg = load_config(
        "grpo",
        [
            *OTB,
            "data.train_batch_size=2",
            "data.max_response_length=8",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "trainer.total_training_steps=1",
            "trainer.val_before_train=false",
            "trainer.device=cpu",
            f"trainer.output_dir={tmp_path}",
        ],
    )
    run = Run(PPOTrainer(cfg))
    try:
        (metrics,) = run.setup().fit()
    finally:
        run.shutdown()
    assert metrics["timing_s/old_log_prob"] > 0
    assert metrics["variance_proxy/expected_w"] > 0
    assert math.isfinite(metrics["variance_proxy/proxy2_total_power"])
    (batch,) = seen
    want, _ = optimal_token_baseline_advantages(
        batch["token_level_rewards"],
        batch["response_mask"],
        batch["uid"],
        batch["old_log_probs"],
        batch["sum_pi_squared"],
    )
    torch.testing.assert_close(batch["advantages"], want)
