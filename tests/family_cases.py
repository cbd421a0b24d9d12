"""Tiny random models of every family the native engine runs, each with its family's
special options on, and the two-rank worker of the families' tensor-parallel test.

Every config is built by transformers' own config class: 2 layers, hidden 64, a
vocabulary of 320, sliding windows (where the family has them) of 5 tokens, shorter
than the prompts, soft-caps small enough to bind. The worker runs in processes started
by `torch.multiprocessing.spawn`, so it lives in a module of its own.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM

from native_toys import perturbed
from rayrl.rollout import NativeRolloutEngine, SamplingParams

WINDOW = 5
COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
ALTERNATING = ["sliding_attention", "full_attention"]
# Few slots and blocks, a small prefill budget: chunked prefill, continuous batching.
SMALL = dict(device="cpu", block_size=4, max_num_seqs=3, max_num_batched_tokens=8)
PROMPTS = [np.random.default_rng(i).integers(3, 300, 4 + 3 * i).tolist() for i in range(4)]
GREEDY = SamplingParams(do_sample=False, max_new_tokens=8, ignore_eos=True)


def _phi3_rope() -> dict:
    """Phi-3-128k's longrope over half of each head (Phi-4-mini's partial rotary)."""
    half = 16 // 2 // 2  # head 16, rotary dims 8: 4 frequencies
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "short_factor": [1.0, 1.5, 2.0, 3.0][:half],
        "long_factor": [2.0, 4.0, 8.0, 16.0][:half],
        "original_max_position_embeddings": 64,
    }


def _gemma3_rope() -> dict:
    return {
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }


# family -> (transformers config class, its options)
FAMILIES = {
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW, head_dim=16)),
    "ministral": (
        "MinistralConfig",
        dict(sliding_window=WINDOW, layer_types=ALTERNATING, head_dim=16),
    ),
    "gemma": ("GemmaConfig", dict(head_dim=16, tie_word_embeddings=True)),
    "gemma2": (
        "Gemma2Config",
        dict(
            head_dim=16,
            sliding_window=WINDOW,
            layer_types=ALTERNATING,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=4.0,
            tie_word_embeddings=True,
        ),
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        dict(
            head_dim=16,
            sliding_window=WINDOW,
            layer_types=ALTERNATING,
            query_pre_attn_scalar=20,
            final_logit_softcapping=5.0,
            rope_parameters=_gemma3_rope(),
        ),
    ),
    "phi3": (
        "Phi3Config",
        dict(
            sliding_window=WINDOW,
            rope_parameters=_phi3_rope(),
            original_max_position_embeddings=64,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        ),
    ),
    "olmo2": ("Olmo2Config", dict(attention_bias=True, pad_token_id=0)),
    "olmo3": (
        "Olmo3Config",
        dict(sliding_window=WINDOW, layer_types=["sliding_attention"] * 2, pad_token_id=0),
    ),
    "granite": (
        "GraniteConfig",
        dict(
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            attention_multiplier=0.15,
            logits_scaling=2.0,
            attention_bias=True,
        ),
    ),
    "seed_oss": ("SeedOssConfig", dict(attention_bias=True, attention_out_bias=False, head_dim=16)),
    "qwen2": (  # a family that moved, with the sliding windows it gained on CPU
        "Qwen2Config",
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, pad_token_id=0),
    ),
    # Mixtures of experts: 4 experts (8 for Mixtral), top-2, dense layers beside sparse.
    "qwen2_moe": (  # layers 0 and 2 sparse, 1 dense; a shared expert; top-2 as they are
        "Qwen2MoeConfig",
        dict(
            num_hidden_layers=3,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=80,
            mlp_only_layers=[1],
            norm_topk_prob=False,
            pad_token_id=0,
        ),
    ),
    "qwen3_moe": (  # layer 0 dense, 1 sparse (every second); top-2 renormalised
        "Qwen3MoeConfig",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            decoder_sparse_step=2,
            norm_topk_prob=True,
            head_dim=16,
            pad_token_id=0,
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=64, pad_token_id=0),
    ),
}


def family_config(family: str, **changes):
    """The tiny transformers config of ``family`` (eager attention: transformers' sdpa
    path ignores Gemma 2's soft-capping, its eager path is the reference)."""
    name, options = FAMILIES[family]
    config = getattr(transformers, name)(**{**COMMON, **options, **changes})
    config._attn_implementation = "eager"
    return config


def family_model(family: str, seed: int = 1, **changes) -> torch.nn.Module:
    """A tiny random model of ``family`` (weights made to vary token to token)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config(family, **changes))
    return perturbed(model, seed=seed).eval()


TP_FAMILIES = ("gemma2", "phi3", "granite")


def outputs(engine: NativeRolloutEngine) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's greedy ``(tokens, log_probs)`` on `PROMPTS`."""
    out = engine.generate_token_ids(PROMPTS, GREEDY)
    return out.tokens, out.log_probs


def tp_worker(rank: int, init_file: str, dirs: dict[str, str], out_dir: str) -> None:
    """Each of `TP_FAMILIES` at TP=2 on gloo, from its files (each rank reads its parts);
    phi3's weights then through the sharded stream from an FSDP2 training engine."""
    import torch.distributed as dist

    from rayrl.rollout.native.tp import make_tp_groups
    from rayrl.rollout.native.tp_weights import tp_rollout_weights
    from rayrl.train.engine import TrainEngine

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        options = dict(**make_tp_groups(2, 2).engine_options, **SMALL, max_model_len=64)
        result, engines = {}, {}
        for family in TP_FAMILIES:
            engines[family] = NativeRolloutEngine(model_path=dirs[family], **options)
            result[family] = outputs(engines[family])
        trainer = TrainEngine(dirs["phi3_b"])  # FSDP2 over the two ranks
        engine = engines["phi3"]  # fused q/k/v and gate/up: whole tensors, split on load
        stream = tp_rollout_weights(trainer.model, torch.float32, engine.spec, 2, 1 << 14)
        result["phi3_count"] = engine.update_weights(stream, sharded=True)
        result["phi3_b"] = outputs(engine)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


MOE_FAMILIES = ("qwen2_moe", "qwen3_moe", "mixtral")


def moe_tp_worker(rank: int, init_file: str, dirs: dict[str, str], out_dir: str) -> None:
    """Each of `MOE_FAMILIES` at TP=2 on gloo, from its files (per-expert tensors, each
    rank reads its parts), then (Qwen3-MoE, Mixtral) updated with another model's whole
    tensors as transformers holds them (fused 3-D experts); Qwen2-MoE's weights then
    into an empty engine through the sharded stream from an FSDP2 training engine."""
    import torch.distributed as dist

    from rayrl.rollout.native.tp import make_tp_groups
    from rayrl.rollout.native.tp_weights import tp_rollout_weights
    from rayrl.train.engine import TrainEngine

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        options = dict(**make_tp_groups(2, 2).engine_options, **SMALL, max_model_len=64)
        result = {}
        for family in MOE_FAMILIES:
            engine = NativeRolloutEngine(model_path=dirs[family], **options)
            result[family] = outputs(engine)
            if family != "qwen2_moe":  # its update: the stream below
                engine.update_weights(family_model(family, seed=2).state_dict().items())
                result[f"{family}_b"] = outputs(engine)
        trainer = TrainEngine(dirs["qwen2_moe"])  # FSDP2 over the two ranks
        engine = NativeRolloutEngine(model_path=dirs["qwen2_moe"], load_weights=False, **options)
        stream = tp_rollout_weights(trainer.model, torch.float32, engine.spec, 2, 1 << 14)
        result["stream_count"] = engine.update_weights(stream, sharded=True)
        result["stream"] = outputs(engine)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
