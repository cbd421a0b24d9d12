"""Every model family of the native engine against transformers, on CPU in float32.

For each family (`family_cases.FAMILIES`: a tiny random model that transformers builds
from the family's own config class, with the family's special options on: sliding
windows shorter than the prompts, soft-caps, QK-norms, biases, multipliers, partial and
longrope rotary, fused HF tensors, tied heads) the native engine's greedy tokens equal
transformers' greedy ``generate()``, and its log-probs those of one plain forward of
the prompt and response. Then what a family is: one registered unit that the engine
finds by ``model_type``, the Triton gaps `rollout.name=auto` steps around on a GPU,
the tensor-parallel plan at TP=2 (gloo processes), and a GRPO step through
``rayrl train`` with the native rollout's log-probs next to the actor's.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from family_cases import (
    FAMILIES,
    GREEDY,
    PROMPTS,
    SMALL,
    TP_FAMILIES,
    family_config,
    family_model,
    outputs,
    tp_worker,
)
from native_toys import perturbed
from rayrl.rollout import NativeRolloutEngine
from rayrl.rollout.native.families import FAMILIES as REGISTERED
from rayrl.rollout.native.families import Family, family_for, spec_of
from rayrl.rollout.native.spec import UnsupportedModelError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def hf_greedy(model, prompt: list[int], new: int) -> list[int]:
    """transformers' greedy ``generate()``, never stopping early."""
    config = GenerationConfig(
        do_sample=False, max_new_tokens=new, eos_token_id=None, pad_token_id=0
    )
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), generation_config=config)
    return out[0, len(prompt) :].tolist()


def hf_log_probs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """Log-probs of ``response`` after ``prompt`` from one plain forward."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(response)[:, None])[:, 0]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_matches_transformers(family):
    model = family_model(family)
    engine = NativeRolloutEngine(model=model, max_model_len=64, **SMALL)
    assert engine.spec.model_type == model.config.model_type
    out = engine.generate_token_ids(PROMPTS, GREEDY)
    assert out.tokens.tolist() == [hf_greedy(model, p, GREEDY.max_new_tokens) for p in PROMPTS]
    for prompt, tokens, log_probs in zip(PROMPTS, out.tokens, out.log_probs, strict=True):
        expected = hf_log_probs(model, prompt, tokens.tolist())
        torch.testing.assert_close(log_probs, expected, atol=1e-4, rtol=1e-4)


def test_variants_are_read_from_the_config():
    """What each family's options became (a test above is only as good as the options
    it turned on)."""
    spec = {f: spec_of(family_config(f)) for f in FAMILIES}
    assert spec["mistral"].windows == (5, 5) and spec["ministral"].windows == (5, 0)
    assert spec["qwen2"].windows == (0, 5) and spec["qwen2"].qkv_bias
    g2, g3 = spec["gemma2"], spec["gemma3_text"]
    assert (g2.norm_layout, g2.norm_offset, g2.activation) == ("sandwich", 1.0, "gelu_tanh")
    assert (g2.attn_softcap, g2.final_softcap, g2.attn_scale) == (3.0, 4.0, 24**-0.5)
    assert g2.embed_scale == 8.0 and g2.embed_scale_in_dtype and g2.tie_embeddings
    assert g3.qk_norm and g3.rope_tables == (1, 0) and g3.attn_softcap == 0.0  # sorted types
    assert spec["phi3"].rotary_dim == 8 and spec["phi3"].windows == (5, 5)
    o2 = spec["olmo2"]
    assert (o2.norm_layout, o2.qk_norm, o2.qk_norm_per_head, o2.norm_in_float) == (
        "post",
        True,
        False,
        True,
    )
    granite = spec["granite"]
    assert (granite.embed_scale, granite.residual_scale, granite.logits_divisor) == (3, 0.5, 2)
    assert spec["seed_oss"].qkv_bias and not spec["seed_oss"].o_bias


@pytest.mark.parametrize(
    ("family", "norm"),
    [
        ("mistral", "mistral.modeling_mistral.MistralRMSNorm"),
        ("gemma", "gemma.modeling_gemma.GemmaRMSNorm"),
        ("olmo2", "olmo2.modeling_olmo2.Olmo2RMSNorm"),
    ],
)
def test_norm_styles_round_as_transformers_in_bfloat16(family, norm):
    """Where the norm weight multiplies (the rounded or the float32 normed values), which
    float32 cannot show: the op with the family's style equals transformers' bit for bit."""
    import importlib

    from rayrl.rollout.native.ops import TorchOps

    module, name = norm.rsplit(".", 1)
    hf = getattr(importlib.import_module(f"transformers.models.{module}"), name)(64, eps=1e-6)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(64, generator=gen))
    hf = hf.to(torch.bfloat16)
    x = (torch.randn(7, 64, generator=gen) * 3).to(torch.bfloat16)
    spec = spec_of(family_config(family))
    style = dict(offset=spec.norm_offset, in_float=spec.norm_in_float)
    with torch.no_grad():
        assert torch.equal(TorchOps.rms_norm(x, hf.weight, 1e-6, **style), hf(x))


def test_gemma_embedding_scale_is_rounded_to_the_model_dtype():
    model = family_model("gemma", hidden_size=48).to(torch.bfloat16)  # sqrt(48): not exact
    engine = NativeRolloutEngine(model=model, dtype=torch.bfloat16, max_model_len=64, **SMALL)
    ids = torch.tensor([3, 17, 200])
    with torch.no_grad():
        assert torch.equal(engine.model._embed(ids), model.model.embed_tokens(ids))


def test_families_are_registered_units_found_by_model_type():
    assert {"qwen2", "qwen3", "llama", *FAMILIES} <= set(REGISTERED.names())
    assert all(issubclass(REGISTERED.get(name), Family) for name in REGISTERED.names())
    assert type(family_for(family_config("gemma3_text"))).__name__ == "Gemma3Text"
    with pytest.raises(UnsupportedModelError, match="'gpt2' is not supported.*rollout.name=hf"):
        family_for("gpt2")
    with pytest.raises(UnsupportedModelError, match="mlp_bias=True.*rollout.name=hf"):
        spec_of(family_config("granite", mlp_bias=True))
    with pytest.raises(UnsupportedModelError, match="activation 'relu'"):
        spec_of(family_config("gemma", hidden_act="relu"))


def test_phi3_longrope_refuses_sequences_past_its_original_length():
    model = family_model("phi3")
    with pytest.raises(UnsupportedModelError, match="max_model_len .* at most 64"):
        NativeRolloutEngine(model=model, max_model_len=65, **SMALL)


def test_cuda_gaps_send_auto_to_hf_and_name_the_feature():
    """What the Triton kernels lack (sliding windows shorter than the model's positions,
    soft-capped scores, partial rotary) sends `auto` to hf on a GPU; the other families
    take the native engine there. An explicit native with Triton kernels says why."""
    native = NativeRolloutEngine.unsupported_reason
    for family in ("gemma", "olmo2", "granite", "seed_oss"):
        assert native("cuda", family_config(family)) is None, family
    assert native("cuda", family_config("mistral", sliding_window=None)) is None
    assert native("cuda", family_config("mistral", sliding_window=256)) is None  # >= positions
    assert "sliding-window attention" in native("cuda", family_config("mistral"))
    gemma2 = native("cuda", family_config("gemma2", sliding_window=None))
    assert "soft-capped attention scores" in gemma2 and "rollout.name=hf" in gemma2
    assert "rotary embedding over 8 of the 16" in native("cuda", family_config("phi3"))
    model = family_model("gemma3_text")
    with pytest.raises(UnsupportedModelError, match="sliding-window.*Triton kernels"):
        NativeRolloutEngine(model=model, max_model_len=64, kernels="triton", **SMALL)


def test_olmo2_refuses_tensor_parallelism():
    from rayrl.rollout.native.shards import check_tp_size

    with pytest.raises(ValueError, match="q and k norms span all heads"):
        check_tp_size(spec_of(family_config("olmo2")), 2)


# ---------------------------------------------------------------- TP=2
@pytest.fixture(scope="module")
def tp_dirs(tmp_path_factory):
    from rayrl.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("families_tp")
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(root / "tok", vocab_size=320))
    dirs = {}
    for key, family, seed in [(f, f, 1) for f in TP_FAMILIES] + [("phi3_b", "phi3", 2)]:
        family_model(family, seed=seed).save_pretrained(root / key)
        tokenizer.save_pretrained(root / key)
        dirs[key] = str(root / key)
    return dirs


@pytest.mark.slow
def test_tp2_matches_one_rank_for_new_families(tp_dirs, tmp_path):
    mp.spawn(tp_worker, args=(str(tmp_path / "init"), tp_dirs, str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    one = dict(SMALL, max_model_len=64)
    for key in (*TP_FAMILIES, "phi3_b"):
        tokens, log_probs = outputs(NativeRolloutEngine(model_path=tp_dirs[key], **one))
        for rank in ranks:
            assert torch.equal(rank[key][0], tokens), key
            torch.testing.assert_close(rank[key][1], log_probs, atol=1e-4, rtol=1e-4)
    assert not torch.equal(ranks[0]["phi3"][0], ranks[0]["phi3_b"][0])  # the update shows
    assert ranks[0]["phi3_count"] == len(family_model("phi3").state_dict())  # HF names


# ---------------------------------------------------------------- GRPO
@pytest.mark.slow
@pytest.mark.timeout(900)  # a run in a process of its own, on a loaded 2-core machine
def test_grpo_step_with_native_rollout_of_a_new_family(tmp_path):
    """`rayrl train` on a tiny Phi-3 (fused HF tensors synced into the native engine,
    partial rotary) with the native rollout's log-probs compared to the actor's."""
    from conftest import start_local_ray

    gcs = start_local_ray().get_runtime_context().gcs_address
    model = tmp_path / "phi3"
    data = tmp_path / "train.parquet"
    rows = [{"question": f"{a} plus {b}?", "answer": f"#### {a + b}"} for a, b in [(1, 2), (3, 4)]]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for args in (
        ["models", "tiny", "--family", "phi3", "--out", str(model)],
        ["data", "gsm8k", str(tmp_path / "rows.jsonl"), str(data)],
    ):
        done = _rayrl(*args)
        assert done.returncode == 0, done.stderr[-3000:]
    # Larger weights: peaked token probabilities, whose differences show (near-uniform
    # ones of a freshly initialised model would differ by little whatever went wrong).
    perturbed(AutoModelForCausalLM.from_pretrained(model)).save_pretrained(model)
    run = tmp_path / "run"
    done = _rayrl(
        "train",
        "-c",
        "grpo",
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files={data}",
        "data.max_prompt_length=64",
        "data.max_response_length=8",
        "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1",  # two: the old-log-prob pass runs
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.name=native",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "trainer.total_training_steps=1",
        "trainer.val_before_train=false",
        "trainer.device=cpu",
        "trainer.logger=[console]",
        f"trainer.output_dir={run}",
        f"resources.address={gcs}",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert metrics["training/rollout_probs_diff_max"] <= 1e-3, metrics


def _rayrl(*args: str) -> subprocess.CompletedProcess:
    import os

    done = subprocess.run(
        [sys.executable, "-m", "rayrl.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=800,
        env=os.environ,
    )
    assert "Traceback" not in done.stderr, done.stderr[-4000:]
    return done


def test_a_window_no_shorter_than_the_longest_sequence_is_left_out_of_the_attention():
    """Mistral's 4096-token window over 2048 positions hides nothing: the layer attends
    plainly (the Triton kernels, which have no window, run it), a shorter window stays."""
    import torch

    from rayrl.rollout.native.model import _LayerPlan
    from rayrl.rollout.native.spec import ModelSpec

    spec = ModelSpec(
        model_type="mistral",
        layers=2,
        hidden=8,
        heads=2,
        kv_heads=1,
        head_dim=4,
        intermediate=16,
        vocab=32,
        rms_eps=1e-6,
        qkv_bias=False,
        o_bias=False,
        qk_norm=False,
        tie_embeddings=False,
        max_positions=2048,
        windows=(4096, 512),
    )
    cos = sin = torch.zeros(1, 2048, 4)
    assert _LayerPlan.of(spec, 0, cos, sin).attention == {}
    assert _LayerPlan.of(spec, 1, cos, sin).attention == {"window": 512}
