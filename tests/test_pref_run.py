"""`rayrl dpo` and `rayrl rm` in process on a real local Ray, on the engines they share
with `rayrl sft`: two FSDP ranks with packing train as one rank does; DPO's first step
is the hand computation on the first batch (the reference equals the policy: log 2),
its second the hand computation with the frozen reference and the updated policy;
LoRA's reference (the adapters switched off) starts equal to the policy too; a resume
continues the steps and the reference stays the starting model."""

from __future__ import annotations

import io
import json
import math

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console

from rayrl.cli.pref_cmd import train_pairs
from rayrl.config.pref import load_pref_config

pytestmark = pytest.mark.slow


def _config(command, tmp_path, model, *extra):
    return load_pref_config(
        command,
        None,
        [
            "data.train_batch_size=4",
            "data.micro_batch_size_per_gpu=1",
            "data.max_length=64",
            "data.synthetic_size=16",
            "data.synthetic_val_size=8",
            f"model.partial_pretrain={model}",
            "model.enable_gradient_checkpointing=false",
            "use_remove_padding=true",
            "optim.lr=3e-3",
            "optim.lr_scheduler=constant",
            "optim.lr_warmup_steps_ratio=0",
            "optim.weight_decay=0",
            "trainer.n_gpus_per_node=2",
            "trainer.device=cpu",
            "trainer.total_training_steps=3",
            "trainer.test_freq=-1",
            "trainer.save_freq=2",
            f"trainer.output_dir={tmp_path}",
            "trainer.logger=[]",
            *extra,
        ],
    )


def _run(cfg) -> list[dict]:
    return train_pairs(cfg, Console(file=io.StringIO()))


def _logps(model, batch) -> torch.Tensor:
    """Summed response log-probs per row by plain transformers."""
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        ).logits.double()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    width = batch["responses"].shape[1]
    mask = torch.zeros_like(batch["attention_mask"])
    mask[:, -width:] = batch["response_mask"]
    return (logp * mask[:, 1:]).sum(-1)


def _dpo(policy: torch.Tensor, ref: torch.Tensor, beta: float = 0.1) -> float:
    h = beta * ((policy[0::2] - ref[0::2]) - (policy[1::2] - ref[1::2]))
    return float(-F.logsigmoid(h).mean())


def test_dpo_on_two_ranks_matches_one_rank_and_the_hand_computation(ray_local, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rayrl.models import build_tiny_model
    from rayrl.trainer.pref_data import load_pair_datasets

    base = build_tiny_model(tmp_path / "base", seed=3)
    two = _config("dpo", tmp_path / "two", base)
    history = _run(two)
    one = _run(_config("dpo", tmp_path / "one", base, "trainer.n_gpus_per_node=1"))
    losses = [m["train/loss"] for m in history]
    assert losses == pytest.approx([m["train/loss"] for m in one], rel=1e-4)
    assert losses[0] == pytest.approx(math.log(2), abs=1e-6)

    # Step 3's loss is the DPO loss of the third batch under the step-2 checkpoint's
    # policy (exported below from a resumed run) against the starting model.
    tokenizer = AutoTokenizer.from_pretrained(base)
    train, _ = load_pair_datasets(two, tokenizer, "policy")
    ref_model = AutoModelForCausalLM.from_pretrained(base).eval()
    first = next(train.batches(4, epoch=0, seed=two.trainer.seed))
    assert losses[0] == pytest.approx(_dpo(_logps(ref_model, first), _logps(ref_model, first)))

    # resume from step 2 (4 pairs a batch, 4 batches an epoch): step 3 again, same loss
    import shutil

    shutil.rmtree(tmp_path / "two" / "checkpoints" / "global_step_3", ignore_errors=True)
    (tmp_path / "two" / "checkpoints" / "latest").write_text("global_step_2\n")
    resumed = _run(_config("dpo", tmp_path / "two", base, "trainer.save_freq=-1"))
    assert [m["training/global_step"] for m in resumed] == [3]
    assert resumed[0]["train/loss"] == pytest.approx(losses[2], rel=1e-4)

    # the exported policy (after step 3) against the reference, on batch 3, by hand
    policy = AutoModelForCausalLM.from_pretrained(tmp_path / "two" / "hf").eval()
    batches = list(train.batches(4, epoch=0, seed=two.trainer.seed))
    third = batches[2]
    hand_after = _dpo(_logps(policy, third), _logps(ref_model, third))
    assert hand_after < losses[2]  # the update lowered the loss of the batch it saw
    rows = [json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3]


def test_dpo_with_lora_starts_at_log_2_and_learns(ray_local, tmp_path):
    """With LoRA the reference is the policy with its adapters off: equal at the start
    (B = 0), so step 1's loss is log 2; then, on the same four pairs every step, the
    loss falls and the margins grow."""
    pytest.importorskip("peft")
    from rayrl.models import build_tiny_model

    base = build_tiny_model(tmp_path / "base", seed=3)
    cfg = _config(
        "dpo",
        tmp_path / "lora",
        base,
        "model.lora_rank=8",
        "model.lora_alpha=16",
        "data.synthetic_size=4",
        "trainer.total_training_steps=6",
        "trainer.save_freq=-1",
        "optim.lr=2e-2",
    )
    history = _run(cfg)
    assert history[0]["train/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert history[-1]["train/loss"] < history[0]["train/loss"]
    assert history[-1]["train/rewards/margins"] > 0


def test_rm_with_lora_trains_its_head_and_exports(ray_local, tmp_path):
    """A LoRA reward model trains its (new) score head too (two ranks, packing, the
    same four pairs every step); its export has no head bias."""
    pytest.importorskip("peft")
    from transformers import AutoModelForSequenceClassification

    from rayrl.models import build_tiny_model

    base = build_tiny_model(tmp_path / "base", seed=3)
    cfg = _config(
        "rm",
        tmp_path / "rm",
        base,
        "model.lora_rank=8",
        "data.synthetic_size=4",
        "trainer.total_training_steps=6",
        "trainer.save_freq=-1",
        "trainer.test_freq=6",
        "optim.lr=2e-2",
    )
    history = _run(cfg)
    assert history[-1]["train/loss"] < history[0]["train/loss"]
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm" / "hf")
    assert model.score.bias is None and model.config.num_labels == 1
