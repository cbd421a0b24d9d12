"""What the native engine needs to know of an HF decoder model, read from its config.

A `ModelSpec` holds a decoder's shapes and its layer variants (norm placement and style,
QK-norm, sliding windows, soft-capping, scales, partial rotary, ...): the defaults are
Llama's. A mixture-of-experts model's spec holds a `MoESpec` too: its experts, routing
and which layers have them (`rayrl.rollout.native.moe` runs it). Which config makes which spec is a model family's business: each family is one
registered unit (`rayrl.rollout.native.families`), whose `spec_of` asks the family of
the config's ``model_type``; a model no family runs, or a feature its family does not
implement, is refused with `UnsupportedModelError`, whose message names the feature and
the way out (the ``hf`` rollout engine runs any causal LM). The families' `rotary_tables`
computes the cos/sin tables with the model's own transformers rotary class, so positions
match transformers bit for bit whatever the rope type.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["HINT", "NORM_LAYOUTS", "MoESpec", "ModelSpec", "UnsupportedModelError"]

HINT = "use actor_rollout_ref.rollout.name=hf, which runs any transformers causal LM"
# Where a decoder layer's norms sit, as the weight slots each layout has (`weights`):
# "pre" (Llama): before attention and before the MLP; "sandwich" (Gemma 2 and 3): also on
# each sublayer's output, before the residual add; "post" (OLMo 2): on the outputs only.
NORM_LAYOUTS = {
    "pre": ("attn_norm", "mlp_norm"),
    "sandwich": ("attn_norm", "attn_out_norm", "mlp_norm", "mlp_out_norm"),
    "post": ("attn_out_norm", "mlp_out_norm"),
}


class UnsupportedModelError(ValueError):
    """The model has a feature the native engine does not implement."""


@dataclass(frozen=True)
class MoESpec:
    """A mixture-of-experts MLP (`rayrl.rollout.native.moe`): a router picks ``top_k`` of
    ``experts`` SwiGLU experts per token, and their outputs are summed, each scaled by its
    routing weight; a shared expert may run on every token beside them."""

    experts: int
    top_k: int
    intermediate: int  # each expert's width
    layers: tuple[bool, ...]  # per layer: its MLP is this mixture (False: a dense MLP)
    norm_topk: bool = False  # the top-k probabilities are renormalised to sum to 1
    weights_in_float: bool = False  # the routing weights scale in float32 (Mixtral)
    shared: int = 0  # the shared expert's width (0: none)
    shared_gate: bool = False  # sigmoid(x @ gate) scales the shared expert (Qwen2-MoE)


@dataclass(frozen=True)
class ModelSpec:
    """Shapes and options of a supported decoder model (defaults: Llama's layer)."""

    model_type: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rms_eps: float
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    tie_embeddings: bool
    max_positions: int
    norm_layout: str = "pre"  # a key of NORM_LAYOUTS
    norm_offset: float = 0.0  # Gemma: the norm scales by (offset + weight)
    norm_in_float: bool = False  # the weight multiplies float32 values (Gemma, OLMo 2)
    qk_norm_per_head: bool = True  # False: one norm over all heads' q, and k (OLMo 2)
    activation: str = "silu"  # the MLP's gate: silu, gelu_tanh or gelu
    windows: tuple[int, ...] = ()  # per layer: attend to the last w tokens (0: all)
    rope_tables: tuple[int, ...] = ()  # per layer: which rotary table (Gemma 3's two)
    rotary_dim: int = 0  # dims of a head that rotate (partial rotary); 0: all
    attn_scale: float = 0.0  # the softmax scale; 0: 1 / sqrt(head_dim)
    attn_softcap: float = 0.0  # scores -> cap * tanh(scores / cap); 0: none
    final_softcap: float = 0.0  # the same on the logits
    embed_scale: float = 1.0  # the embedding rows are multiplied by it
    embed_scale_in_dtype: bool = False  # Gemma: the scale rounded to the model dtype first
    residual_scale: float = 1.0  # each sublayer's output, before the residual add (Granite)
    logits_divisor: float = 1.0  # the logits are divided by it (Granite)
    moe: MoESpec | None = None  # the layers' mixture-of-experts MLP (None: all dense)
    # positions have three axes (time, height, width: Qwen2-VL's M-RoPE); a text token's
    # are equal, so decode and text use the one-axis table, a prefill with images
    # per-token tables from the model's rotary module (`families.qwen2_vl`)
    mrope: bool = False

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.heads // self.kv_heads

    @property
    def q_size(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def norm_slots(self) -> tuple[str, ...]:
        """The norm weights each layer has (`NORM_LAYOUTS`)."""
        return NORM_LAYOUTS[self.norm_layout]

    def window(self, layer: int) -> int:
        """Layer ``layer``'s sliding window (0: it attends to every earlier token)."""
        return self.windows[layer] if self.windows else 0

    def rope_table(self, layer: int) -> int:
        """Which rotary table layer ``layer`` uses."""
        return self.rope_tables[layer] if self.rope_tables else 0

    def layer_moe(self, layer: int) -> MoESpec | None:
        """Layer ``layer``'s mixture of experts (`moe`), or None where its MLP is dense."""
        return self.moe if self.moe is not None and self.moe.layers[layer] else None

    def is_moe(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is the mixture of experts (`moe`)."""
        return self.layer_moe(layer) is not None

    def mlp_width(self, layer: int) -> int:
        """The width of layer ``layer``'s dense MLP: its own, or in a mixture-of-experts
        layer its shared expert's (0: none)."""
        moe = self.layer_moe(layer)
        return moe.shared if moe is not None else self.intermediate

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V cache that one token takes over all layers."""
        return 2 * self.layers * self.kv_size * torch.empty((), dtype=dtype).element_size()
