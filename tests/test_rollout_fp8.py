"""FP8 rollout (`actor_rollout_ref.rollout.quantization=fp8`) on CPU: the emulated
e4m3 quantization of weights and inputs, the native engine sampling with it, weight
syncs re-quantizing in place, the config's refusals, and one GRPO step through
`rayrl train` with truncated importance sampling on by itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from native_toys import perturbed
from rayrl.batch import Batch
from rayrl.config import load_config
from rayrl.config.errors import ConfigError
from rayrl.models.tiny import build_tiny_model
from rayrl.rollout import NativeRolloutEngine, SamplingParams, positions_from_mask
from rayrl.rollout.native.fp8 import FP8_MAX, Fp8Weight, fp8_linear

TINY = dict(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab_size=320)
ENGINE = dict(device="cpu", block_size=4, max_num_seqs=4, max_num_batched_tokens=16)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("fp8") / "tiny", **TINY)
    perturbed(AutoModelForCausalLM.from_pretrained(path)).save_pretrained(path)
    return str(path)


def test_each_row_is_scaled_to_e4m3s_range_and_rounded_within_its_precision():
    weight = torch.randn(40, 32) * torch.logspace(-3, 2, 40)[:, None]  # rows of any scale
    copy = Fp8Weight.empty(*weight.shape, weight.dtype, weight.device).copy_(weight)
    assert copy.weight.dtype == torch.float8_e4m3fn and not copy.fast  # CPU: emulated
    assert torch.allclose(copy.weight.float().abs().amax(1), torch.full((40,), FP8_MAX))
    err = (copy.dequantized - weight).abs()
    assert bool((err <= weight.abs() / 16 + copy.scale[:, None] * 2**-9).all())  # 3 bits
    assert err.max() > 0  # rounded, not copied


def test_an_fp8_matmul_is_close_to_the_full_one_and_not_equal():
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(5, 32, generator=gen), torch.randn(48, 32, generator=gen)
    copy = Fp8Weight.empty(*weight.shape, weight.dtype, weight.device).copy_(weight)
    full, quantized = F.linear(x, weight), fp8_linear(x, copy)
    rel = (quantized - full).norm() / full.norm()
    assert 0 < rel < 0.1


def _prompts(tokenizer) -> Batch:
    texts = ["1 + 2 =", "the answer is", "hello there", "what is 9 - 4"]
    enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left")
    columns = {**enc, "position_ids": positions_from_mask(enc["attention_mask"])}
    uids = [f"p{i}" for i in range(len(texts))]
    return Batch.from_dict({**columns, "uid": uids}, meta={"step": 0})


def test_the_engine_samples_from_the_quantized_weights(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts, greedy = _prompts(tokenizer), SamplingParams(temperature=0.0, max_new_tokens=8)
    plain = NativeRolloutEngine(model_path=model_dir, **ENGINE)
    fp8 = NativeRolloutEngine(model_path=model_dir, quantization="fp8", **ENGINE)
    matrices = [w for layer in fp8.weights.layers for w in vars(layer).values()]
    assert sum(isinstance(w, Fp8Weight) for w in matrices) == 2 * 4  # qkv, o, gate_up, down
    a, b = plain.generate(prompts, greedy), fp8.generate(prompts, greedy)
    same = (a["responses"] == b["responses"]).float().mean()
    diff = (a["rollout_log_probs"] - b["rollout_log_probs"]).abs().max()
    assert same > 0.5  # mostly the same tokens ...
    assert diff > 1e-4  # ... from other numerics


def _fp8_storage(engine) -> list[int]:
    layers = engine.weights.layers
    return [
        w.weight.data_ptr()
        for layer in layers
        for w in vars(layer).values()
        if isinstance(w, Fp8Weight)
    ]


def test_a_weight_sync_requantizes_in_place(model_dir):
    """After `update_weights`, the engine samples as one built on the new weights: its
    FP8 copies were rewritten (the same tensors, so CUDA graphs stay valid)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = _prompts(tokenizer)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8, seed=3)
    other = perturbed(AutoModelForCausalLM.from_pretrained(model_dir), seed=1)
    engine = NativeRolloutEngine(model_path=model_dir, quantization="fp8", **ENGINE)
    storage = _fp8_storage(engine)
    before = engine.generate(prompts, sampling)
    engine.update_weights(other.state_dict())
    after = engine.generate(prompts, sampling)
    fresh = NativeRolloutEngine(model=other, tokenizer=tokenizer, quantization="fp8", **ENGINE)
    expected = fresh.generate(prompts, sampling)
    assert torch.equal(after["responses"], expected["responses"])
    assert torch.equal(after["rollout_log_probs"], expected["rollout_log_probs"])
    assert not torch.equal(before["rollout_log_probs"], after["rollout_log_probs"])
    assert _fp8_storage(engine) == storage


def test_fp8_needs_the_native_engine(model_dir):
    with pytest.raises(ConfigError, match="rollout.name=hf has no FP8 path"):
        load_config(
            "grpo",
            ["actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.quantization=fp8"],
        )
    with pytest.raises(ConfigError, match="one of"):
        load_config("grpo", ["actor_rollout_ref.rollout.quantization=int4"])
    from transformers import AutoConfig

    from rayrl.rollout.base import resolve_rollout

    cfg = load_config("grpo", ["actor_rollout_ref.rollout.quantization=fp8"])
    with pytest.raises(ValueError, match="auto on cpu: hf"):  # auto picks hf on a CPU
        resolve_rollout(
            cfg.actor_rollout_ref.rollout, cfg.data, "cpu", AutoConfig.from_pretrained(model_dir)
        )


@pytest.mark.command
def test_one_grpo_step_with_fp8_rollout_corrects_by_importance_ratios(tmp_path, model_dir):
    """docs/performance.md's command (below), for one step of a small model."""
    # rayrl train -c grpo actor_rollout_ref.rollout.name=native actor_rollout_ref.rollout.quantization=fp8  # noqa: E501
    from conftest import train_one_step

    common = (
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.rollout.name=native",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "actor_rollout_ref.actor.ppo_epochs=2",  # a separate old-log-prob pass
    )
    plain = train_one_step(tmp_path / "plain", *common)
    fp8 = train_one_step(tmp_path / "fp8", *common, "actor_rollout_ref.rollout.quantization=fp8")
    assert plain["training/rollout_probs_diff_max"] < 1e-4  # fp32: the same numerics
    assert fp8["training/rollout_probs_diff_max"] > 10 * plain["training/rollout_probs_diff_max"]
    assert "actor/tis_weight_mean" in fp8  # truncated importance sampling, on by itself
    assert "actor/tis_weight_mean" not in plain


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FP8 tensor cores are on GPUs")
def test_on_a_card_with_fp8_tensor_cores_the_matmul_runs_there_as_emulated():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("this card has no FP8 tensor cores")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 256, generator=gen).cuda().bfloat16()
    weight = torch.randn(512, 256, generator=gen).cuda().bfloat16()
    fast = Fp8Weight.empty(*weight.shape, weight.dtype, weight.device).copy_(weight)
    emulated = Fp8Weight(fast.weight, fast.scale, False, fast.weight.float() * fast.scale[:, None])
    assert fast.fast
    a, b = fp8_linear(x, fast).float(), fp8_linear(x.float(), emulated)
    full = F.linear(x.float(), weight.float())
    assert (a - b).norm() / b.norm() < 1e-2  # bf16 output rounding
    assert 0 < (a - full).norm() / full.norm() < 0.1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel runs on CUDA")
def test_the_triton_row_quantization_equals_torchs():
    from rayrl.rollout.native.fp8 import _quantized_input
    from rayrl.rollout.native.triton_fp8 import quantize_rows

    x = (torch.randn(33, 3000) * torch.logspace(-2, 2, 33)[:, None]).cuda().bfloat16()
    q, scale = quantize_rows(x)
    q_ref, scale_ref = _quantized_input(x)
    # torch divides by a scalar as a multiplication by its reciprocal: 1 ulp apart
    assert torch.allclose(scale, scale_ref, rtol=2e-7, atol=0)
    step = (q.float() - q_ref.float()).abs() / q_ref.float().abs().clamp(min=2**-9)
    assert (q != q_ref).float().mean() < 1e-3 and step.max() <= 0.125  # a rounding apart


@pytest.mark.slow
def test_fp8_composes_with_async_agents_lora_and_tensor_parallel_replicas(ray_local, tmp_path):
    """An FP8 rollout on a replica split over two ranks, generating multi-turn episodes
    asynchronously for a LoRA actor: the episodes train token-exact, corrected by
    their importance ratios."""
    from async_cases import EXACT, SMALL, end_turns_often
    from rayrl.trainer.async_ppo import AsyncPPOTrainer
    from rayrl.trainer.run import Run

    model = build_tiny_model(tmp_path / "m", layers=2, hidden=64, seed=4)
    perturbed(AutoModelForCausalLM.from_pretrained(model)).save_pretrained(model)
    end_turns_often(str(model), share=1 / 6)  # turns of about 6 tokens: tool calls
    overrides = [
        *SMALL,
        *EXACT,
        "trainer.total_training_steps=2",
        "actor_rollout_ref.rollout.name=native",
        "actor_rollout_ref.rollout.quantization=fp8",
        "rollout.n_gpus_per_node=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.model.lora_rank=4",
        f"trainer.output_dir={tmp_path / 'run'}",
        f"actor_rollout_ref.model.path={model}",
    ]
    printed: list[str] = []
    run = Run(AsyncPPOTrainer(load_config("grpo", overrides), print_fn=printed.append))
    try:
        run.setup()
        history = run.fit()
    finally:
        run.shutdown()
    assert len(history) == 2, printed
    for row in history:
        assert row["rollout/token_mismatch"] == 0 and row["multi_turn/num_turns/mean"] > 2
        assert "actor/tis_weight_mean" in row and row["training/rollout_probs_diff_max"] > 1e-4
