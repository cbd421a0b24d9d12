"""Phi-3 and Phi-3.5 (mini, medium) and Phi-4-mini: Llama's layer with q, k and v in one HF
tensor (``qkv_proj``) and gate and up in another (``gate_up_proj``), a rotary embedding
over part of each head (``partial_rotary_factor``: Phi-4-mini's 0.75), sliding windows
(``sliding_window``), and longrope scaling (Phi-3-*-128k) while sequences stay within
``original_max_position_embeddings``.

The fused tensors are split into the standard names on load, so the tensor-parallel
plan is the standard one (each rank narrows the q, k, v, gate and up parts it holds).
"""

from rayrl.rollout.native.families.base import FAMILIES, rope_parameters, sliding_windows
from rayrl.rollout.native.families.llama import Llama


@FAMILIES.register("phi3")
class Phi3(Llama):
    fused = {
        "self_attn.qkv_proj.weight": (
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
        ),
        "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    }

    def variants(self, config) -> dict:
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        factor = rope_parameters(config).get(
            "partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)
        )
        rotary = int(head_dim * factor)
        return {
            "qkv_bias": False,
            "o_bias": False,
            "qk_norm": False,
            "windows": sliding_windows(config),
            "rotary_dim": rotary if rotary < head_dim else 0,
        }
