"""LoRA on the training engine: only adapters train, the base model is the reference,
and the merged export loads in transformers with the trained behaviour."""

from __future__ import annotations

import torch

from engine_cases import OPTIM, pg_loss, ragged_batch, tiny_model_dir  # noqa: F401
from rayrl.train.engine import TrainEngine
from rayrl.train.lora import LoraSpec

LORA = LoraSpec(lora_rank=4, lora_alpha=8, target_modules=("q_proj", "v_proj", "down_proj"))


def _engine(model_dir, lora=LORA) -> TrainEngine:
    return TrainEngine(model_dir, optim={**OPTIM, "lr": 5e-2}, lora=lora, use_remove_padding=False)


def test_lora_trains_adapters_only_and_reference_is_the_base(tiny_model_dir):  # noqa: F811
    engine = _engine(tiny_model_dir)
    base = TrainEngine(tiny_model_dir, trainable=False, use_remove_padding=False)
    batch = ragged_batch(8, seed=1)
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    trainable = {n for n, p in engine.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    # fresh adapters (B = 0) change nothing yet
    torch.testing.assert_close(engine.forward(batch)["log_probs"], base.forward(batch)["log_probs"])
    for _ in range(2):
        metrics = engine.train_step(batch, pg_loss, micro_batch_size=4)
        assert metrics["skipped"] == 0
    after = dict(engine.model.named_parameters())
    changed = {n for n in before if not torch.equal(before[n], after[n].detach())}
    assert changed and changed <= trainable
    assert any(".lora_B." in n for n in changed)
    trained = engine.forward(batch)["log_probs"]
    assert not torch.allclose(trained, base.forward(batch)["log_probs"])
    with engine.adapters_disabled():
        torch.testing.assert_close(
            engine.forward(batch)["log_probs"], base.forward(batch)["log_probs"]
        )
    # adapters are back on after the block
    torch.testing.assert_close(engine.forward(batch)["log_probs"], trained)


def test_lora_merged_export_loads_and_matches(tiny_model_dir, tmp_path):  # noqa: F811
    from transformers import AutoModelForCausalLM

    engine = _engine(tiny_model_dir)
    batch = ragged_batch(8, seed=2)
    engine.train_step(batch, pg_loss, micro_batch_size=8)
    state = engine.full_state_dict()
    assert not any("lora_" in k or "base_layer" in k for k in state)
    engine.export_hf(tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    engine.model.eval()
    with torch.no_grad():
        expected = engine.model(input_ids=ids, attention_mask=mask).logits
        got = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
