"""The transformers config of a tiny model of each decoder family (`TinySpec.family`).

`family_config` turns a tiny shape (layers, hidden, heads, ...) and its special-token
ids into the config of that family's own transformers class, with the family's own
defaults for everything else (Gemma 2's soft-caps and alternating sliding windows,
Phi-3's fused tensors, OLMo 2's post-norms, the mixtures of experts' routers, ...), so
`rayrl models tiny --family F` builds a small model of the shape `rayrl train` and the
native rollout engine meet in the real one. Qwen2, the default, is built by `TinySpec.to_config` itself, as always.
`NORM_ZERO` names the families whose norms scale by ``1 + weight``: their identity norm
is a zero weight. transformers is imported only when a config is made (the CLI's
``--help`` lists the families without it).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["FAMILIES", "MOE_WIDTHS", "NORM_ZERO", "family_config"]

# model_type -> (transformers config class, options beyond the shape)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {}),
    "ministral": ("MinistralConfig", {}),
    "gemma": ("GemmaConfig", {}),
    "gemma2": ("Gemma2Config", {}),
    "gemma3_text": ("Gemma3TextConfig", {}),
    "phi3": ("Phi3Config", {}),
    "olmo2": ("Olmo2Config", {}),
    "olmo3": ("Olmo3Config", {}),
    "granite": ("GraniteConfig", {}),
    "seed_oss": ("SeedOssConfig", {}),
    # mixtures of experts: 4 experts, top-2 (`MOE_WIDTHS`: each expert half the MLP width)
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {"num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True},
    ),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
}
# The mixtures' widths beside `intermediate` (the dense MLP's): each expert's, and
# Qwen2-MoE's shared expert's, half of it (Mixtral's experts take `intermediate` itself)
MOE_WIDTHS = {
    "qwen2_moe": ("moe_intermediate_size", "shared_expert_intermediate_size"),
    "qwen3_moe": ("moe_intermediate_size",),
}
NORM_ZERO = ("gemma", "gemma2", "gemma3_text")


def family_config(family: str, shape: dict[str, Any], ids: dict[str, int]) -> Any:
    """``family``'s config for ``shape`` (transformers' names: hidden_size, ...) and the
    special-token ``ids`` (bos_token_id, eos_token_id, pad_token_id)."""
    if family not in FAMILIES:
        raise ValueError(
            f"TinySpec.family={family!r} is not one of {sorted(FAMILIES)}; pick one of them."
        )
    name, options = FAMILIES[family]
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    extra: dict[str, Any] = {"head_dim": head_dim}
    if family in ("gemma2", "gemma3_text"):
        extra["query_pre_attn_scalar"] = head_dim
    for width in MOE_WIDTHS.get(family, ()):
        extra[width] = max(shape["intermediate_size"] // 2, 1)
    config_class = getattr(importlib.import_module("transformers"), name)
    return config_class(**shape, **ids, **extra, **options)
