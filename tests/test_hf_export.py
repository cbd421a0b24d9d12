"""`rayrl export`: a checkpoint of a LoRA policy trained in bf16 becomes an HF directory
that transformers loads in bf16 with the adapters merged, giving the engine's logits."""

from __future__ import annotations

import torch

from engine_cases import ragged_batch, tiny_model_dir  # noqa: F401 (fixture)
from rayrl.cli.main import main
from rayrl.train.engine import TrainEngine
from rayrl.train.hf_export import write_hf_meta
from rayrl.train.lora import LoraSpec

LORA = LoraSpec(lora_rank=4, lora_alpha=8, target_modules=("q_proj", "v_proj"))


def test_export_of_a_lora_checkpoint_merges_adapters_in_the_training_dtype(
    tmp_path,
    tiny_model_dir,  # noqa: F811
):
    dtype = "bfloat16"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    engine = TrainEngine(tiny_model_dir, optim={"lr": 1e-2}, lora=LORA, dtype=dtype)
    assert engine.training_dtype == dtype
    with torch.no_grad():  # trained adapters: B is zero at init, which would merge to nothing
        for name, p in engine.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    ckpt = tmp_path / "checkpoints" / "global_step_1"
    engine.save(ckpt / "actor")
    write_hf_meta(engine, ckpt / "actor")
    out = tmp_path / "hf"
    assert main(["export", str(ckpt), str(out)]) == 0

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    assert not any("lora" in k for k in model.state_dict())
    AutoTokenizer.from_pretrained(out)
    batch = ragged_batch(4, seed=3)
    expected = engine.forward(batch, micro_batch_size=4)["log_probs"]
    width = batch["responses"].shape[1]
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        ).logits[:, -width - 1 : -1]
    got = torch.log_softmax(logits.float(), -1).gather(-1, batch["responses"].unsqueeze(-1))
    mask = batch["attention_mask"][:, -width:].bool()
    # bf16 weights: the merged W + BA is rounded once more than the engine's W x + B(A x)
    torch.testing.assert_close(got.squeeze(-1)[mask], expected[mask], atol=0.1, rtol=0.05)
    without_merge = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    with torch.no_grad():
        base = without_merge(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        ).logits[:, -width - 1 : -1]
    assert not torch.allclose(base.float(), logits.float(), atol=0.05)  # adapters did change it


def test_export_names_what_is_missing(tmp_path, capsys):
    assert main(["export", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "holds no actor checkpoint" in capsys.readouterr().err
