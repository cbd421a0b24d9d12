"""`rayrl sft` end to end on a real local Ray: two FSDP ranks with packing, parquet in
verl's SFT columns, loss on response tokens only (checked against a hand computation
that differs when prompt tokens count), the loss going down, validation loss,
checkpoints, resume, and an HF export that transformers loads."""

from __future__ import annotations

import io
import json
import math

import pytest
import torch
from rich.console import Console

from rayrl.cli.sft_cmd import sft
from rayrl.config.sft import load_sft_config
from rayrl.data import write_parquet
from rayrl.data.synthetic import demonstrations

pytestmark = pytest.mark.slow


def _config(tmp_path, model, *extra):
    rows = demonstrations("larger", 24, seed=5)
    train = write_parquet(rows[:16], tmp_path / "train.parquet")
    val = write_parquet(rows[16:], tmp_path / "val.parquet")
    return load_sft_config(
        None,
        [
            f"data.train_files={train}",
            f"data.val_files={val}",
            "data.train_batch_size=8",
            "data.micro_batch_size_per_gpu=2",
            "data.max_length=64",
            f"model.partial_pretrain={model}",
            "model.enable_gradient_checkpointing=false",
            "use_remove_padding=true",
            "optim.lr=3e-3",
            "optim.lr_scheduler=constant",
            "optim.lr_warmup_steps_ratio=0",
            "trainer.n_gpus_per_node=2",
            "trainer.device=cpu",
            "trainer.total_training_steps=10",
            "trainer.test_freq=5",
            "trainer.save_freq=5",
            f"trainer.output_dir={tmp_path / 'run'}",
            "trainer.logger=[]",
            *extra,
        ],
    )


def _response_nll(model, batch, with_prompt: bool = False) -> float:
    """Token-mean NLL of the response tokens of a padded batch, by plain transformers
    (or, `with_prompt`, of every real token after the first: what a loss that let the
    prompt in would be)."""
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        ).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    if with_prompt:
        mask = batch["attention_mask"][:, 1:] * batch["attention_mask"][:, :-1]
    else:
        width = batch["responses"].shape[1]
        mask = torch.zeros_like(batch["attention_mask"])
        mask[:, -width:] = batch["response_mask"]
        mask = mask[:, 1:]
    return float(-(logp * mask).sum() / mask.sum())


def test_sft_learns_responses_only_checkpoints_resumes_exports(ray_local, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rayrl.models import build_tiny_model
    from rayrl.trainer.sft_data import load_sft_datasets

    base = build_tiny_model(tmp_path / "base", seed=3)
    cfg = _config(tmp_path, base)
    history = sft(cfg, Console(file=io.StringIO()))
    losses = [m["train/loss"] for m in history]
    assert len(history) == 10 and losses[-1] < 0.7 * losses[0], losses

    # Step 1's loss (before any update) is the response-only NLL of the first batch.
    tokenizer = AutoTokenizer.from_pretrained(base)
    train, _ = load_sft_datasets(cfg, tokenizer)
    first = next(train.batches(8, epoch=0, seed=cfg.trainer.seed, shuffle=True))
    model = AutoModelForCausalLM.from_pretrained(base).eval()
    assert losses[0] == pytest.approx(_response_nll(model, first), rel=1e-4)

    val = [m["val/loss"] for m in history if "val/loss" in m]
    assert len(val) == 2 and val[1] < val[0]
    out = tmp_path / "run"
    assert (out / "checkpoints" / "latest").read_text().strip() == "global_step_10"
    assert (out / "checkpoints" / "global_step_5" / "trainer_state.pt").is_file()

    trained = AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    assert AutoTokenizer.from_pretrained(out / "hf").eos_token == tokenizer.eos_token

    # Two more steps resume from step 10 (2 batches an epoch: epoch 5, batch 0). Step
    # 11's loss, before its update, is the exported model's response-only NLL of that
    # batch; with the prompt tokens in, the trained model's figure is far off.
    resumed = sft(
        _config(tmp_path, base, "trainer.total_training_steps=12"), Console(file=io.StringIO())
    )
    assert [m["training/global_step"] for m in resumed] == [11, 12]
    batch = next(train.batches(8, epoch=5, seed=cfg.trainer.seed, shuffle=True))
    expected = _response_nll(trained, batch)
    assert resumed[0]["train/loss"] == pytest.approx(expected, rel=1e-4)
    assert abs(_response_nll(trained, batch, with_prompt=True) - expected) > 1.0
    assert expected < _response_nll(model, batch) - 1.0  # and SFT did learn the responses
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 13))
    assert all(math.isfinite(m["train/loss"]) for m in resumed)


def test_sft_with_sequence_parallel_ranks_trains_like_one_rank(ray_local, tmp_path):
    """Two ranks in one Ulysses group (`ulysses_sequence_parallel_size=2`, verl's key)
    take the same rows and split their tokens: step 1's loss is the hand-computed NLL of
    the whole first batch, and the losses follow a one-rank run's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rayrl.models import build_tiny_model
    from rayrl.trainer.sft_data import load_sft_datasets

    base = build_tiny_model(tmp_path / "base", seed=3)
    common = ["trainer.total_training_steps=3", "trainer.test_freq=-1", "trainer.save_freq=-1"]
    split = _config(tmp_path / "sp", base, "ulysses_sequence_parallel_size=2", *common)
    assert split.dp_size == 1
    one = _config(tmp_path / "one", base, "trainer.n_gpus_per_node=1", *common)
    sp_losses = [m["train/loss"] for m in sft(split, Console(file=io.StringIO()))]
    one_losses = [m["train/loss"] for m in sft(one, Console(file=io.StringIO()))]

    tokenizer = AutoTokenizer.from_pretrained(base)
    train, _ = load_sft_datasets(split, tokenizer)
    first = next(train.batches(8, epoch=0, seed=split.trainer.seed, shuffle=True))
    model = AutoModelForCausalLM.from_pretrained(base).eval()
    assert sp_losses[0] == pytest.approx(_response_nll(model, first), rel=1e-4)
    assert sp_losses == pytest.approx(one_losses, rel=1e-4)
