"""The router's load-balancing loss of a mixture-of-experts model in the training loss
(`rayrl.train.moe_aux`): added as transformers computes it when the model's config
enables router logits, and absent when it does not."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_cases import OPTIM, pg_loss, ragged_batch
from parallel_cases import record_gradients
from rayrl.train.engine import TrainEngine

COEF = 0.05
ON = {"output_router_logits": True, "router_aux_loss_coef": COEF}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from rayrl.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("moe") / "m", family="qwen3_moe", seed=3)


def _hf_aux(model_dir, batch):
    """transformers' own: (aux_loss, loss with labels minus the cross-entropy, grads of
    coef x aux_loss by name)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **ON)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        labels=labels,
    )
    ce = model.loss_function(out.logits, labels, model.config.vocab_size)
    (COEF * out.aux_loss).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.aux_loss.detach(), (out.loss - ce).detach(), grads


def _zero_loss(outputs, micro):
    return outputs["log_probs"].sum() * 0.0, {}


def test_aux_loss_added_as_transformers_computes_it(moe_dir):
    batch = ragged_batch(4, seed=5)
    aux, added, hf_grads = _hf_aux(moe_dir, batch)
    assert float(aux) > 0 and torch.allclose(added, COEF * aux, atol=1e-7)

    engine = TrainEngine(moe_dir, optim=OPTIM, config_overrides=ON)
    metrics = engine.train_step(batch, pg_loss, micro_batch_size=4)
    assert metrics["moe_aux_loss"] == pytest.approx(float(aux), rel=1e-5)
    assert metrics["loss"] == pytest.approx(metrics["pg_loss"] + COEF * float(aux), rel=1e-5)

    engine = TrainEngine(moe_dir, optim=OPTIM, config_overrides=ON)
    grads = record_gradients(engine)
    engine.train_step(batch, _zero_loss, micro_batch_size=4)
    routers = [n for n in hf_grads if n.endswith("gate.weight")]
    assert routers and all(hf_grads[n].abs().sum() > 0 for n in routers)
    for name, grad in hf_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-7, rtol=1e-5, msg=name)


def test_no_aux_loss_when_the_config_disables_router_logits(moe_dir):
    engine = TrainEngine(moe_dir, optim=OPTIM)
    assert not engine.config.output_router_logits
    metrics = engine.train_step(ragged_batch(4, seed=5), pg_loss, micro_batch_size=2)
    assert "moe_aux_loss" not in metrics
    assert metrics["loss"] == pytest.approx(metrics["pg_loss"], rel=1e-6)
