"""TrainEngine in one process on a tiny Qwen2: log-probs, micro-batching, steps, state."""

from __future__ import annotations

import pytest
import torch

from engine_cases import (
    OPTIM,
    pg_loss,
    ragged_batch,
    tiny_model_dir,  # noqa: F401 (fixture)
    value_loss,
)
from rayrl.train.engine import TrainEngine
from rayrl.train.optim import OptimSpec, build_lr_scheduler
from rayrl.train.outputs import MODEL_INPUTS


def _reference_log_probs(engine: TrainEngine, batch) -> torch.Tensor:
    """Full-vocabulary log-softmax of the padded model output, read off by hand."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    resp = batch["responses"].shape[1]
    with torch.no_grad():
        logits = engine.model(
            input_ids=ids, attention_mask=mask, position_ids=batch["position_ids"]
        ).logits
    logp = torch.log_softmax(logits[:, -resp - 1 : -1].float(), dim=-1)
    picked = logp.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    return picked * batch["response_mask"]


def _grad_recorder(engine: TrainEngine) -> dict[str, torch.Tensor]:
    """Record each parameter's gradient after accumulation (before clipping)."""
    grads: dict[str, torch.Tensor] = {}
    for name, p in engine.model.named_parameters():
        p.register_post_accumulate_grad_hook(
            lambda param, name=name: grads.__setitem__(name, param.grad.detach().clone())
        )
    return grads


def test_packed_and_padded_log_probs_equal_the_reference(tiny_model_dir):  # noqa: F811
    batch = ragged_batch(7, seed=3)
    packed = TrainEngine(tiny_model_dir, use_remove_padding=True, logit_chunk_size=5)
    padded = TrainEngine(tiny_model_dir, use_remove_padding=False)
    out_packed = packed.forward(batch, micro_batch_size=3, with_entropy=True, temperature=0.7)
    out_padded = padded.forward(batch, micro_batch_size=7, with_entropy=True, temperature=0.7)
    torch.testing.assert_close(out_packed["log_probs"], out_padded["log_probs"], atol=1e-5, rtol=0)
    torch.testing.assert_close(out_packed["entropy"], out_padded["entropy"], atol=1e-5, rtol=0)
    reference = _reference_log_probs(padded, batch)
    torch.testing.assert_close(packed.forward(batch)["log_probs"], reference, atol=1e-5, rtol=0)
    assert (out_packed["log_probs"][batch["response_mask"] == 0] == 0).all()


def test_token_budget_forward_restores_row_order(tiny_model_dir):  # noqa: F811
    engine = TrainEngine(tiny_model_dir)
    batch = ragged_batch(9, seed=4)
    plain = engine.forward(batch, micro_batch_size=9)
    budget = engine.forward(batch, max_tokens_per_micro_batch=30)
    torch.testing.assert_close(budget["log_probs"], plain["log_probs"], atol=1e-5, rtol=0)


def test_the_model_inputs_alone_give_the_same_log_probs_and_step(tiny_model_dir):  # noqa: F811
    """What the trainer sends a pass (`MODEL_INPUTS`: no responses, only their mask for
    the width) gives bitwise what the whole batch gives."""
    batch = ragged_batch(6, seed=5)
    lean = batch.select(*MODEL_INPUTS, "advantages")
    engine = TrainEngine(tiny_model_dir, optim=OPTIM)
    for kwargs in ({"micro_batch_size": 3}, {"max_tokens_per_micro_batch": 40}):
        whole = engine.forward(batch, with_entropy=True, **kwargs)
        alone = engine.forward(lean, with_entropy=True, **kwargs)
        assert torch.equal(whole["log_probs"], alone["log_probs"])
        assert torch.equal(whole["entropy"], alone["entropy"])
    other = TrainEngine(tiny_model_dir, optim=OPTIM)
    assert engine.train_step(batch, pg_loss) == other.train_step(lean, pg_loss)
    params = zip(engine.model.named_parameters(), other.model.parameters(), strict=True)
    for (name, a), b in params:
        assert torch.equal(a, b), name


def test_micro_batching_gives_the_same_gradients(tiny_model_dir):  # noqa: F811
    """One micro-batch (packed), fixed-size ones (padded), token-budget ones (packed)."""
    batch = ragged_batch(8, seed=5)
    runs = {
        "whole": ({"micro_batch_size": 8}, True),
        "fixed": ({"micro_batch_size": 3}, False),
        "budget": ({"max_tokens_per_micro_batch": 32}, True),
    }
    grads, weights, metrics = {}, {}, {}
    for name, (split, packed) in runs.items():
        engine = TrainEngine(tiny_model_dir, optim=OPTIM, use_remove_padding=packed)
        grads[name] = _grad_recorder(engine)
        metrics[name] = engine.train_step(batch, pg_loss, **split)
        weights[name] = engine.model.state_dict()
    assert metrics["budget"]["micro_batches"] > 1 and metrics["fixed"]["micro_batches"] == 3
    for name in ("fixed", "budget"):
        assert metrics[name]["loss"] == pytest.approx(metrics["whole"]["loss"], rel=1e-6)
        for key, grad in grads["whole"].items():
            torch.testing.assert_close(grads[name][key], grad, atol=1e-6, rtol=1e-4, msg=key)
        for key, value in weights["whole"].items():
            torch.testing.assert_close(weights[name][key], value, atol=1e-5, rtol=0, msg=key)


def test_gradient_checkpointing_gives_the_same_gradients(tiny_model_dir):  # noqa: F811
    batch = ragged_batch(4, seed=6)
    grads = []
    for checkpointing in (False, True):
        engine = TrainEngine(tiny_model_dir, optim=OPTIM, gradient_checkpointing=checkpointing)
        grads.append(_grad_recorder(engine))
        engine.train_step(batch, pg_loss, micro_batch_size=2)
    for key, grad in grads[0].items():
        torch.testing.assert_close(grads[1][key], grad, atol=1e-6, rtol=1e-5, msg=key)


def test_non_finite_gradient_step_is_skipped(tiny_model_dir):  # noqa: F811
    engine = TrainEngine(tiny_model_dir, optim=OPTIM)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    batch = ragged_batch(4, seed=7)

    def nan_loss(outputs, micro):
        loss, metrics = pg_loss(outputs, micro)
        return loss * float("nan"), metrics

    metrics = engine.train_step(batch, nan_loss, mini_batch_size=2)
    assert metrics["skipped"] == 2 and engine.skipped_steps == 2
    assert engine.optimizer_steps == 0 and not engine.optimizer.state
    for key, value in engine.model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert all(p.grad is None for p in engine.model.parameters())
    metrics = engine.train_step(batch, pg_loss)
    assert metrics["skipped"] == 0 and engine.skipped_steps == 2 and engine.optimizer_steps == 1


@pytest.mark.parametrize("file_per_tensor", [False, True])
def test_save_load_round_trip(tiny_model_dir, tmp_path, monkeypatch, file_per_tensor):  # noqa: F811
    from rayrl.train import checkpoint_io

    if file_per_tensor:  # the layout of a large state on a GPU (bounded host memory)
        monkeypatch.setattr(checkpoint_io, "ONE_FILE_MAX_BYTES", -1)
    optim = {**OPTIM, "lr_scheduler": "cosine", "warmup_steps": 1}
    batch = ragged_batch(6, seed=8)
    first = TrainEngine(tiny_model_dir, optim=optim, total_steps=6)
    for _ in range(2):  # past the warm-up: the schedule's position matters from here
        first.train_step(batch, pg_loss, mini_batch_size=3)
    first.save(tmp_path / "ckpt")
    files = list((tmp_path / "ckpt").glob("*.distcp"))
    assert len(files) > 20 if file_per_tensor else len(files) == 1
    second = TrainEngine(tiny_model_dir, optim=optim, total_steps=6)
    second.load(tmp_path / "ckpt")
    assert torch.equal(second.forward(batch)["log_probs"], first.forward(batch)["log_probs"])
    assert second.scheduler.get_last_lr() == first.scheduler.get_last_lr()
    assert (second.train_steps, second.optimizer_steps) == (2, 4)
    # The optimizer and the LR schedule came back too: the next steps stay identical,
    # each at the learning rate the uninterrupted engine uses (a schedule restarted
    # from its first step would use other ones).
    for _ in range(2):
        lrs = first.train_step(batch, pg_loss)["lr"], second.train_step(batch, pg_loss)["lr"]
        assert lrs[0] == lrs[1], lrs
    for key, value in first.model.state_dict().items():
        assert torch.equal(second.model.state_dict()[key], value), key
    with pytest.raises(FileNotFoundError, match="not a rayrl engine checkpoint"):
        second.load(tmp_path)


def test_export_hf_loads_with_transformers(tiny_model_dir, tmp_path):  # noqa: F811
    from transformers import AutoModelForCausalLM, AutoTokenizer

    engine = TrainEngine(tiny_model_dir, optim=OPTIM)
    engine.train_step(ragged_batch(4, seed=9), pg_loss)
    engine.export_hf(tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(model).__name__ == "Qwen2ForCausalLM"
    ids = ragged_batch(3, seed=10)["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, engine.model(ids).logits)
    assert AutoTokenizer.from_pretrained(tmp_path / "hf")("1+1=2")["input_ids"]


def test_value_head_packed_equals_padded_and_trains(tiny_model_dir, pack_on_cpu):  # noqa: F811
    batch = ragged_batch(6, seed=11)
    packed = TrainEngine(tiny_model_dir, value_head=True, optim=OPTIM, seed=3)
    padded = TrainEngine(
        tiny_model_dir, value_head=True, optim=OPTIM, seed=3, use_remove_padding=False
    )
    values = packed.forward(batch, micro_batch_size=4)["values"]
    assert values.shape == batch["responses"].shape and values.abs().sum() > 0
    torch.testing.assert_close(values, padded.forward(batch)["values"], atol=1e-5, rtol=0)
    losses = [packed.train_step(batch, value_loss)["loss"] for _ in range(3)]
    assert losses[-1] < losses[0]


def test_offload_and_onload(tiny_model_dir):  # noqa: F811
    engine = TrainEngine(tiny_model_dir, optim=OPTIM)
    batch = ragged_batch(3, seed=12)
    engine.train_step(batch, pg_loss)
    before = engine.forward(batch)["log_probs"]
    engine.offload()
    with pytest.raises(RuntimeError, match="call onload"):
        engine.forward(batch)
    engine.onload()
    assert torch.equal(engine.forward(batch)["log_probs"], before)
    engine.train_step(batch, pg_loss)


def test_frozen_engine_computes_log_probs_but_does_not_train(tiny_model_dir, tmp_path):  # noqa: F811
    frozen = TrainEngine(tiny_model_dir, trainable=False)
    batch = ragged_batch(3, seed=13)
    expected = TrainEngine(tiny_model_dir).forward(batch)["log_probs"]
    assert torch.equal(frozen.forward(batch)["log_probs"], expected)
    assert not any(p.requires_grad for p in frozen.model.parameters())
    frozen.offload()
    frozen.onload()
    with pytest.raises(RuntimeError, match="trainable=False"):
        frozen.train_step(batch, pg_loss)
    with pytest.raises(RuntimeError, match="trainable=False"):
        frozen.save(tmp_path / "ckpt")


def test_load_errors_say_what_to_pass(tiny_model_dir, tmp_path):  # noqa: F811
    with pytest.raises(FileNotFoundError, match="no config.json; pass a Hugging Face model"):
        TrainEngine(tmp_path)
    with pytest.raises(ValueError, match="dtype 'fp8' is not one of"):
        TrainEngine(tiny_model_dir, dtype="fp8")
    engine = TrainEngine(tiny_model_dir)
    with pytest.raises(KeyError, match="needs input_ids, attention_mask and responses"):
        engine.forward(ragged_batch(2).select("input_ids", "attention_mask"))


def test_lr_schedules():
    model = torch.nn.Linear(2, 2)
    spec = OptimSpec(lr=1.0, lr_scheduler="cosine", warmup_steps=2, min_lr_ratio=0.1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = build_lr_scheduler(optimizer, spec, total_steps=6)
    lrs = []
    for _ in range(7):
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert lrs[:3] == pytest.approx([0.5, 1.0, 1.0])
    assert lrs[4] == pytest.approx(0.1 + 0.9 * 0.5) and lrs[6] == pytest.approx(0.1)
    with pytest.raises(ValueError, match="needs total_steps"):
        build_lr_scheduler(optimizer, spec, total_steps=None)
    with pytest.raises(LookupError, match="Did you mean 'cosine'"):
        OptimSpec(lr_scheduler="cosin")


def test_offloaded_optimizer_steps_slice_by_slice_as_one_step(tiny_model_dir, monkeypatch):  # noqa: F811
    """With optimizer_offload the Adam step runs a slice of parameters at a time (the
    device never holds every moment: a 7B model's are 60 GB), with the same result."""
    from rayrl.train import residency

    monkeypatch.setattr(residency, "STEP_SLICE_BYTES", 64 << 10)
    plain = TrainEngine(tiny_model_dir, optim=OPTIM)
    sliced = TrainEngine(tiny_model_dir, optim=OPTIM, optimizer_offload=True)
    calls = []
    sliced.optimizer.register_step_pre_hook(lambda *_: calls.append(1))
    for seed in (14, 15):
        batch = ragged_batch(4, seed=seed)
        a, b = plain.train_step(batch, pg_loss), sliced.train_step(batch, pg_loss)
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    assert len(calls) > 2 * 4  # several slices per step (the tiny model holds ~0.4 MB)
    for (name, p), q in zip(plain.model.named_parameters(), sliced.model.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert all(p.grad is None for p in sliced.model.parameters())


def test_a_cpu_engine_packs_only_rows_with_much_padding(tiny_model_dir, monkeypatch):  # noqa: F811
    from rayrl.train import outputs

    packs = []
    real_pack = outputs.pack_sequences
    monkeypatch.setattr(outputs, "pack_sequences", lambda *a: packs.append(1) or real_pack(*a))
    engine = TrainEngine(tiny_model_dir, trainable=False)  # use_remove_padding=True
    full = [(12, 10)] * 7
    mostly_real = ragged_batch(8, lengths=[*full, (12, 9)])  # one pad token in 176
    engine.forward(mostly_real)
    assert packs == []  # ran padded: packed rows attend one at a time on a CPU
    engine.forward(ragged_batch(8, lengths=[(3, 2)] * 4 + full[:4]))  # 34% padding
    assert packs == [1]
