"""The models `bench/rollout.py` runs: the reference shape (Qwen2.5-0.5B's sizes, as
Qwen2 or as another dense family), Qwen2.5-7B's sizes, and a mixture of experts of
Qwen3-30B-A3B's layer."""

from __future__ import annotations

import torch

from rayrl.models.tiny import TinySpec, reference_05b

__all__ = ["FAMILIES", "build_model", "dense_7b_config", "family_config", "moe_config"]


def moe_config():
    """Qwen3-30B-A3B's layer (hidden 2048, 32 query and 4 KV heads of 128, 128 experts
    of width 768, top-8 renormalised) at 8 of its 48 layers, its vocabulary: 4.8B
    parameters, 0.7B active a token."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=151936,
        hidden_size=2048,
        num_hidden_layers=8,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        pad_token_id=0,
    )


def dense_7b_config():
    """Qwen2.5-7B's sizes (hidden 3584, 28 layers, 28 query and 4 KV heads, intermediate
    18,944, vocabulary 152,064, untied head): 7.6B parameters, where decode reads
    15 GB of bf16 weights a step (the FP8 rollout's figure)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=152064,
        hidden_size=3584,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=18944,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        pad_token_id=0,
    )


def family_config(family: str):
    """The reference shape (Qwen2.5-0.5B's sizes) as another dense family's config, for
    the families' tokens/s side by side: Mistral (Llama's layer; no sliding window at
    these lengths), Gemma 2 (soft-capping, pre- and post-norms, alternating sliding
    windows of 4096: wider than any workload here), Gemma 3 (text; QK-norm, local and
    global rotary)."""
    import transformers

    ref = reference_05b()
    sizes = dict(
        vocab_size=ref.vocab_size,
        hidden_size=ref.hidden,
        num_hidden_layers=ref.layers,
        num_attention_heads=ref.heads,
        num_key_value_heads=ref.kv_heads,
        intermediate_size=ref.intermediate,
        head_dim=ref.hidden // ref.heads,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        pad_token_id=0,
    )
    name = {"mistral": "MistralConfig", "gemma2": "Gemma2Config", "gemma3": "Gemma3TextConfig"}
    return getattr(transformers, name[family])(**sizes)


FAMILIES = ("mistral", "gemma2", "gemma3")


def build_model(shape: str, device: str):
    from transformers import AutoModelForCausalLM, Qwen2ForCausalLM

    if shape in ("moe", "7b") or shape in FAMILIES:
        configs = {"moe": moe_config, "7b": dense_7b_config}
        config = configs[shape]() if shape in configs else family_config(shape)
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
        model.generation_config.eos_token_id = None
        return model
    spec = (
        reference_05b()
        if shape == "reference"
        else TinySpec(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab_size=512)
    )
    config = spec.to_config()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype).eval()
    model.generation_config.eos_token_id = None  # fixed-length workloads
    return model
