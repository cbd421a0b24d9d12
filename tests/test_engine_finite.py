"""Finite gradients through the RL path at Qwen2.5's vocabulary size, and a non-finite
step that is skipped with the parameters named."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from rayrl.algos import compute_advantages
from rayrl.batch import Batch
from rayrl.config.schema import ActorConfig, RolloutCorrectionConfig
from rayrl.models.tiny import TinySpec
from rayrl.rollout import HFRolloutEngine, SamplingParams
from rayrl.train.engine import TrainEngine
from rayrl.workers.losses import actor_loss_fn

pytestmark = pytest.mark.usefixtures("one_torch_thread")
RESPONSE = 12


@pytest.fixture(scope="module")
def wide_vocab_dir(tmp_path_factory):
    """Qwen2.5's 151936-row vocabulary with a tokenizer of a few hundred tokens, as on
    the reference shape: a random model samples ids that no text maps to."""
    spec = TinySpec(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab_size=151936)
    return spec.build(tmp_path_factory.mktemp("wide") / "m")


def _prompts(tok, rows: int = 3) -> Batch:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, len(tok), (rows, 9), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding
    mask[1, :2] = 0
    uids = np.array([f"p{i}" for i in range(rows)], dtype=object)
    return Batch({"input_ids": ids, "attention_mask": mask}, {"uid": uids}, {"step": 0})


def test_rl_path_gives_finite_gradients(wide_vocab_dir):
    """Rollout on the training module itself (the hybrid engine), old log-probs, then
    PPO updates with zero advantages (a random model's rewards are all equal) and with
    random ones, KL and truncated importance weights on, top-k/top-p sampling at T=0.7."""
    tok = AutoTokenizer.from_pretrained(wide_vocab_dir)
    engine = TrainEngine(wide_vocab_dir, optim={"lr": 1e-3})
    rollout = HFRolloutEngine(model=engine.model, tokenizer=tok)
    params = SamplingParams(n=4, temperature=0.7, top_k=50, top_p=0.9, max_new_tokens=RESPONSE)
    out = rollout.generate(_prompts(tok), params)
    assert int(out["responses"].max()) >= len(tok)  # ids past the tokenizer were sampled
    old = engine.forward(out, micro_batch_size=4, temperature=0.7)["log_probs"]
    mask = out["response_mask"]
    assert torch.isfinite(old).all() and torch.isfinite(out["rollout_log_probs"]).all()
    correction = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0)
    actor = ActorConfig(use_kl_loss=True, clip_ratio_low=0.2, clip_ratio_high=0.2)
    loss_fn = actor_loss_fn(actor, RESPONSE, correction)
    for scores in (torch.zeros(len(out)), torch.randn(len(out))):
        rewards = torch.zeros(mask.shape)
        rewards[torch.arange(len(out)), mask.sum(-1) - 1] = scores
        adv, _ = compute_advantages(
            "grpo", token_level_rewards=rewards, response_mask=mask, index=out["uid"]
        )
        batch = out.union(Batch({"old_log_probs": old, "ref_log_prob": old, "advantages": adv}))
        metrics = engine.train_step(batch, loss_fn, micro_batch_size=5)
        assert metrics["skipped"] == 0 and math.isfinite(metrics["grad_norm"]), metrics


def test_nonfinite_step_is_skipped_and_names_the_parameters(wide_vocab_dir, caplog):
    engine = TrainEngine(wide_vocab_dir)
    tok = AutoTokenizer.from_pretrained(wide_vocab_dir)
    out = HFRolloutEngine(model=engine.model, tokenizer=tok).generate(
        _prompts(tok), SamplingParams(n=1, max_new_tokens=4)
    )
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}

    def nan_loss(outputs, micro):
        return outputs["log_probs"].sum() * float("nan"), {}

    with caplog.at_level(logging.WARNING, logger="rayrl.train.optim"):
        metrics = engine.train_step(out, nan_loss)
    assert metrics["skipped"] == 1 and math.isnan(metrics["grad_norm"])
    assert "optimizer step skipped" in caplog.text and "model.embed_tokens.weight" in caplog.text
    after = engine.model.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)  # nothing moved
