"""FLOP counting: the body without embeddings, the head over the tokens that use it,
causal attention; device peaks by name."""

from __future__ import annotations

from transformers import AutoModelForCausalLM

from engine_cases import tiny_model_dir  # noqa: F401 (fixture: 2 layers, hidden 64, 4 heads)
from rayrl.models import count_parameters
from rayrl.models.flops import FlopModel, peak_flops


def test_flop_model_counts_the_body_head_and_attention(tiny_model_dir):  # noqa: F811
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    fm = FlopModel.of(model)
    counts = count_parameters(tiny_model_dir)  # tied embeddings: the head is the embedding
    assert fm.body_params == counts["non_embedding"]
    assert fm.head_params == 64 * model.config.vocab_size
    assert (fm.layers, fm.attn_width) == (2, 64)
    # Two sequences of 3 and 5 tokens, 4 of them through the head.
    body = 2 * fm.body_params * 8
    head = 2 * fm.head_params * 4
    attention = 2 * 2 * 64 * (9 + 25)
    assert fm.forward_flops([3, 5], 4) == body + head + attention
    assert fm.train_flops([3, 5], 4) == 3 * (body + head + attention)


def test_peak_flops_by_device_name():
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("cpu") is None


def test_a_mixture_of_experts_counts_the_active_experts_only():
    """Top-2 of 4 experts: each token meets half of every expert weight; the router
    and the rest count whole."""
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=True,
    )
    model = AutoModelForCausalLM.from_config(config)
    named = dict(model.named_parameters())
    experts = sum(p.numel() for n, p in named.items() if ".experts." in n)
    rest = sum(p.numel() for n, p in named.items() if ".experts." not in n)
    embedding = model.get_input_embeddings().weight.numel()
    assert experts == 2 * 4 * (2 * 16 * 32 + 32 * 16)
    assert FlopModel.of(model).body_params == rest - embedding + experts // 2
