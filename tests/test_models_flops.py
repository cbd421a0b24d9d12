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
