"""The native engine's forward pass of a decoder over a paged KV cache.

One function of a `StepInput` to next-token logits: embed, then per layer fused
add+RMSNorm, one qkv matmul, rotary embedding fused with the KV-cache write, paged
attention, the output projection, fused add+RMSNorm, one gate_up matmul, SiLU-and-mul,
the down projection; a final norm and the LM head on the rows whose logits are asked
for only. The operations come from `ops` (torch, or Triton on CUDA) and `attention`.

The family's layer variants (`ModelSpec`; `rayrl.rollout.native.families`) change steps
of that sequence, each where its transformers family does: the norms' places (sandwich,
post) and style (Gemma's ``1 + weight``), QK-norm per head or over all heads, a GELU
gate, per-layer sliding windows and rotary tables, soft-capped scores and logits,
scaled embeddings, residual branches and logits. A Llama-shaped model (Qwen2, Qwen3,
Llama) runs exactly the operations it always ran. A mixture-of-experts layer
(`ModelSpec.moe`) runs `rayrl.rollout.native.moe.moe_mlp` as its MLP, its experts the
way `moe.expert_path` picks for the device, and writes each token's experts into the
engine's `routes.RouteStore` where it records them.

Split over tensor-parallel ranks (``tp``), the same code runs the rank's slice (its
heads, KV heads, MLP columns, vocabulary rows: `rayrl.rollout.native.shards`),
with an all-reduce (sum over the ranks) after the masked embedding lookup and after
every layer's output and down projections; the logits are the rank's vocabulary rows.
Without ``tp`` no collective is issued.

A vision-language model's language model (`ModelSpec.mrope`: Qwen2-VL, Qwen2.5-VL) runs
the same layers. A prefill step with images (`StepInput.mrope`) has its image features
put at their placeholder rows after the embedding, and rotates each token by its three
positions: per-token cos/sin tables from the model's own rotary module
(``mrope_rotary``, `rayrl.rollout.native.families.qwen2_vl`), read at the tokens'
indices. Every other step (decode, text) reads the one-axis table, which is M-RoPE's
for a text token (its three positions equal, each offset by its prompt's
``rope_delta``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypedDict

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rayrl.rollout.native.attention import make_attention, triton_gaps
from rayrl.rollout.native.fp8 import Fp8Weight, fp8_linear
from rayrl.rollout.native.kv_cache import KVCache
from rayrl.rollout.native.moe import expert_path, moe_mlp
from rayrl.rollout.native.ops import Ops, TorchOps
from rayrl.rollout.native.routes import RouteStore
from rayrl.rollout.native.spec import ModelSpec, UnsupportedModelError
from rayrl.rollout.native.step import StepInput
from rayrl.rollout.native.tp import TensorParallel
from rayrl.rollout.native.weights import NativeWeights

__all__ = ["NativeModel", "make_ops"]


class _NormStyle(TypedDict, total=False):
    """`TorchOps.rms_norm`'s style arguments (Gemma's, OLMo 2's norms)."""

    offset: float
    in_float: bool


def make_ops(kernels: str) -> Ops:
    """`TritonOps` for ``kernels="triton"`` (imported only then: Triton is optional),
    `TorchOps` for ``"torch"``."""
    if kernels == "triton":
        from rayrl.rollout.native.triton_ops import TritonOps

        return TritonOps()
    return TorchOps()


class NativeModel:
    """Weights, rotary tables and the kernels to run them; `forward` maps a step to logits.

    ``cos``/``sin``: ``[tables, positions, rotary dims]`` (a layer's table:
    `ModelSpec.rope_table`), or one ``[positions, dims]`` table.
    """

    def __init__(
        self,
        spec: ModelSpec,
        weights: NativeWeights,
        cos: Tensor,
        sin: Tensor,
        kernels: str,
        tp: TensorParallel | None = None,
    ) -> None:
        cos, sin = (cos, sin) if cos.dim() == 3 else (cos[None], sin[None])
        self.spec, self.weights, self.cos, self.sin = spec, weights, cos, sin
        self.kernels = kernels  # "torch" or "triton"
        if kernels == "triton" and (gaps := triton_gaps(spec, cos.shape[1])):
            raise UnsupportedModelError(gaps)
        self.ops = make_ops(kernels)
        self.attention = make_attention(kernels)
        self.scale = spec.attn_scale or 1.0 / math.sqrt(spec.head_dim)
        self.tp = tp  # spec and weights are then this rank's slice
        self._reduce = tp.all_reduce if tp is not None else _unchanged
        self._adds_o_bias = tp is None or tp.rank == 0  # added once, before the sum
        self._layers = [_LayerPlan.of(spec, i, cos, sin) for i in range(spec.layers)]
        self.experts: str | None = None  # how the experts run (`moe.EXPERT_PATHS`)
        self.routes: RouteStore | None = None  # each token's experts, where recorded
        # M-RoPE: the model's rotary module, (x, positions [3, 1, T]) -> cos, sin [1, T, D]
        self.mrope_rotary: nn.Module | None = None
        if spec.moe is not None:
            self.experts = expert_path(weights.device, weights.dtype, spec.moe, spec.hidden)
        self._embed_scale = spec.embed_scale
        if spec.embed_scale_in_dtype:  # Gemma: the factor rounded to the model dtype
            self._embed_scale = float(torch.tensor(spec.embed_scale, dtype=weights.dtype))
        styled = spec.norm_offset or spec.norm_in_float
        self._style: _NormStyle = (
            {"offset": spec.norm_offset, "in_float": spec.norm_in_float} if styled else {}
        )

    @torch.inference_mode()
    def forward(self, step: StepInput, cache: KVCache) -> Tensor:
        """Logits [len(step.logits_rows), vocab] in the model dtype (tensor-parallel: of
        this rank's vocabulary rows)."""
        w, reduce = self.weights, self._reduce
        residual, hidden = self._embed(step.input_ids), None
        if step.image_rows is not None and step.image_features is not None:
            features = step.image_features.to(residual.dtype)
            residual = residual.index_copy(0, step.image_rows, features)
        rope = self._mrope(step)
        for i, layer in enumerate(w.layers):
            x, residual = self._enter(hidden, residual, layer.attn_norm)
            hidden = self._attend(i, layer, x, step, cache, rope)
            hidden = self._leave(hidden, layer.attn_out_norm)
            x, residual = self._enter(hidden, residual, layer.mlp_norm)
            hidden = reduce(self._mlp(i, layer, x, step.slot_mapping))
            hidden = self._leave(hidden, layer.mlp_out_norm)
        rows = step.logits_rows
        assert hidden is not None, "a model has at least one layer"
        hidden, _ = self._enter(hidden[rows], residual[rows], w.final_norm)
        return self._head(hidden)

    def _mrope(self, step: StepInput) -> tuple[Tensor, Tensor, Tensor] | None:
        """A prefill with images: (the tokens' indices, per-token cos, sin) for the
        rotary kernel; None for any other step (the layers' tables, `step.positions`)."""
        if step.mrope is None:
            return None
        if self.mrope_rotary is None:
            raise RuntimeError(
                f"native rollout engine: a step with M-RoPE positions on a "
                f"{self.spec.model_type} model, which has no M-RoPE rotary module"
            )
        probe = torch.zeros(1, dtype=torch.float32, device=step.mrope.device)
        cos, sin = self.mrope_rotary(probe, step.mrope.unsqueeze(1))
        indices = torch.arange(step.mrope.shape[1], device=step.mrope.device)
        return indices, cos[0].contiguous(), sin[0].contiguous()

    def _attend(
        self,
        i: int,
        layer,
        x: Tensor,
        step: StepInput,
        cache: KVCache,
        rope: tuple[Tensor, Tensor, Tensor] | None = None,
    ) -> Tensor:
        """Layer ``i``'s attention output (all-reduced), o bias included; ``rope``: the
        tokens' own rotary tables (`_mrope`) in place of the layer's."""
        s, ops, plan = self.spec, self.ops, self._layers[i]
        positions, cos, sin = rope if rope is not None else (step.positions, plan.cos, plan.sin)
        n = x.shape[0]
        qkv = _linear(x, layer.qkv, layer.qkv_bias)
        qk_norm = None
        if layer.q_norm is not None and s.qk_norm_per_head and not self._style:
            qk_norm = (layer.q_norm, layer.k_norm, s.rms_eps)  # fused into the rotary kernel
        elif layer.q_norm is not None:
            qkv = self._qk_normed(qkv, layer)
        k_cache, v_cache = cache.layer(i)
        q = ops.rope_and_store(
            qkv,
            positions,
            cos,
            sin,
            k_cache,
            v_cache,
            step.slot_mapping,
            (s.heads, s.kv_heads, s.head_dim),
            qk_norm,
        )
        attn = self.attention(q, k_cache, v_cache, step, self.scale, **plan.attention)
        o_bias = layer.o_bias if self._adds_o_bias else None
        return self._reduce(_linear(attn.reshape(n, s.q_size), layer.o, o_bias))

    def _enter(self, hidden: Tensor | None, residual: Tensor, norm: Tensor | None):
        """``(a sublayer's input, the residual stream)``: ``hidden`` (the last sublayer's
        output; None before the first) added to the residual, then ``norm``ed (a
        "post"-layout model has none: the sublayer reads the residual stream itself)."""
        s, ops = self.spec, self.ops
        if norm is None:
            residual = residual if hidden is None else residual + hidden
            return residual, residual
        if hidden is None:
            return self._norm(residual, norm), residual
        return ops.add_rms_norm(hidden, residual, norm, s.rms_eps, **self._style)

    def _leave(self, hidden: Tensor, out_norm: Tensor | None) -> Tensor:
        """A sublayer's output as the residual add takes it: normed (sandwich and post
        layouts), scaled (Granite)."""
        if out_norm is not None:
            hidden = self._norm(hidden, out_norm)
        if self.spec.residual_scale != 1.0:
            hidden = hidden * self.spec.residual_scale
        return hidden

    def _norm(self, x: Tensor, weight: Tensor) -> Tensor:
        return self.ops.rms_norm(x, weight, self.spec.rms_eps, **self._style)

    def _qk_normed(self, qkv: Tensor, layer) -> Tensor:
        """``qkv`` with q and k normed on their own (OLMo 2's over all heads; Gemma 3's
        per head in Gemma's style), for the rotary kernel to take as they are."""
        s, n = self.spec, qkv.shape[0]
        q, k, v = qkv.split([s.q_size, s.kv_size, s.kv_size], dim=-1)
        if s.qk_norm_per_head:
            q = self._norm(q.reshape(n, s.heads, s.head_dim), layer.q_norm).reshape(n, -1)
            k = self._norm(k.reshape(n, s.kv_heads, s.head_dim), layer.k_norm).reshape(n, -1)
        else:
            q, k = self._norm(q, layer.q_norm), self._norm(k, layer.k_norm)
        return torch.cat((q, k, v), dim=-1)

    def _mlp(self, i: int, layer, x: Tensor, slots: Tensor) -> Tensor:
        """Layer ``i``'s MLP output (this rank's part of the sum, before the all-reduce);
        a mixture of experts writes its tokens' routing at their cache ``slots`` where
        the engine records it (`routes`)."""
        moe = self.spec.layer_moe(i)
        if moe is not None:
            assert self.experts is not None, "set in __init__ for a mixture of experts"
            out, chosen = moe_mlp(x, layer, moe, self._act, self.experts)
            if self.routes is not None:
                self.routes.write(i, slots, chosen)
            return out
        return _linear(self._act(_linear(x, layer.gate_up)), layer.down)

    def _act(self, gate_up: Tensor) -> Tensor:
        act = self.spec.activation
        if act == "silu":
            return self.ops.silu_and_mul(gate_up)
        return self.ops.gelu_and_mul(gate_up, "tanh" if act == "gelu_tanh" else "none")

    def _head(self, hidden: Tensor) -> Tensor:
        s = self.spec
        logits = F.linear(hidden, self.weights.lm_head)
        if s.logits_divisor != 1.0:
            logits = logits / s.logits_divisor
        if s.final_softcap:
            logits = torch.tanh(logits / s.final_softcap) * s.final_softcap
        return logits

    def _embed(self, ids: Tensor) -> Tensor:
        """Embedding rows; tensor-parallel: each rank looks up the ids in its vocabulary
        rows (zeros for the others), and the sum over ranks has every row exactly."""
        if self.tp is None:
            rows = F.embedding(ids, self.weights.embed)
        else:
            lo, hi = self.tp.shard.vocab_rows
            local = ids - lo
            outside = (local < 0) | (local >= hi - lo)
            rows = F.embedding(local.masked_fill(outside, 0), self.weights.embed)
            rows = self.tp.all_reduce(rows.masked_fill_(outside.unsqueeze(-1), 0))
        return self._scaled(rows)

    def _scaled(self, rows: Tensor) -> Tensor:
        return rows if self._embed_scale == 1.0 else rows * self._embed_scale


@dataclass(frozen=True)
class _LayerPlan:
    """What differs between a model's layers: its rotary table, its attention options."""

    cos: Tensor
    sin: Tensor
    attention: dict  # TorchAttention's window / softcap; empty: plain causal attention

    @classmethod
    def of(cls, spec: ModelSpec, i: int, cos: Tensor, sin: Tensor) -> _LayerPlan:
        """Layer ``i``'s plan; a window no shorter than the rotary tables' positions (the
        longest sequence the engine runs) hides nothing, and is left out (as
        `triton_gaps` leaves it out of what the Triton kernels must do)."""
        table = spec.rope_table(i)
        options: dict[str, float] = {}
        if 0 < spec.window(i) < cos.shape[1]:
            options["window"] = spec.window(i)
        if spec.attn_softcap:
            options["softcap"] = spec.attn_softcap
        return cls(cos[table], sin[table], options)


def _linear(x: Tensor, weight: Tensor | Fp8Weight, bias: Tensor | None = None) -> Tensor:
    """``x`` through a layer's matrix: in FP8 where the weights hold it so
    (`rayrl.rollout.native.fp8`)."""
    if isinstance(weight, Fp8Weight):
        return fp8_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _unchanged(x: Tensor) -> Tensor:
    return x
