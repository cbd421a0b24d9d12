"""The native engine's forward pass of a Qwen2 / Qwen3 / Llama decoder over a paged KV cache.

One function of a `StepInput` to next-token logits: embed, then per layer fused
add+RMSNorm, one qkv matmul, rotary embedding fused with the KV-cache write, paged
attention, the output projection, fused add+RMSNorm, one gate_up matmul, SiLU-and-mul,
the down projection; a final norm and the LM head on the rows whose logits are asked
for only. The operations come from `ops` (torch, or Triton on CUDA) and `attention`.

Split over tensor-parallel ranks (``tp``), the same code runs the rank's slice (its
heads, KV heads, MLP columns, vocabulary rows: `rayrl.rollout.native.shards`),
with an all-reduce (sum over the ranks) after the masked embedding lookup and after
every layer's output and down projections; the logits are the rank's vocabulary rows.
Without ``tp`` no collective is issued.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from rayrl.rollout.native.attention import make_attention
from rayrl.rollout.native.kv_cache import KVCache
from rayrl.rollout.native.ops import TorchOps
from rayrl.rollout.native.spec import ModelSpec
from rayrl.rollout.native.step import StepInput
from rayrl.rollout.native.tp import TensorParallel
from rayrl.rollout.native.weights import NativeWeights

__all__ = ["NativeModel", "make_ops"]


def make_ops(kernels: str) -> TorchOps:
    """`TritonOps` for ``kernels="triton"`` (imported only then: Triton is optional),
    `TorchOps` for ``"torch"``."""
    if kernels == "triton":
        from rayrl.rollout.native.triton_ops import TritonOps

        return TritonOps()
    return TorchOps()


class NativeModel:
    """Weights, rotary tables and the kernels to run them; `forward` maps a step to logits."""

    def __init__(
        self,
        spec: ModelSpec,
        weights: NativeWeights,
        cos: Tensor,
        sin: Tensor,
        kernels: str,
        tp: TensorParallel | None = None,
    ) -> None:
        self.spec, self.weights, self.cos, self.sin = spec, weights, cos, sin
        self.kernels = kernels  # "torch" or "triton"
        self.ops = make_ops(kernels)
        self.attention = make_attention(kernels)
        self.scale = 1.0 / math.sqrt(spec.head_dim)
        self.tp = tp  # spec and weights are then this rank's slice
        self._reduce = tp.all_reduce if tp is not None else _unchanged
        self._adds_o_bias = tp is None or tp.rank == 0  # added once, before the sum

    @torch.inference_mode()
    def forward(self, step: StepInput, cache: KVCache) -> Tensor:
        """Logits [len(step.logits_rows), vocab] in the model dtype (tensor-parallel: of
        this rank's vocabulary rows)."""
        s, w, ops, reduce = self.spec, self.weights, self.ops, self._reduce
        shape = (s.heads, s.kv_heads, s.head_dim)
        n = step.input_ids.shape[0]
        residual = self._embed(step.input_ids)
        hidden = ops.rms_norm(residual, w.layers[0].input_norm, s.rms_eps)
        for i, layer in enumerate(w.layers):
            if i > 0:
                hidden, residual = ops.add_rms_norm(hidden, residual, layer.input_norm, s.rms_eps)
            qkv = F.linear(hidden, layer.qkv, layer.qkv_bias)
            qk_norm = None if layer.q_norm is None else (layer.q_norm, layer.k_norm, s.rms_eps)
            k_cache, v_cache = cache.layer(i)
            q = ops.rope_and_store(
                qkv,
                step.positions,
                self.cos,
                self.sin,
                k_cache,
                v_cache,
                step.slot_mapping,
                shape,
                qk_norm,
            )
            attn = self.attention(q, k_cache, v_cache, step, self.scale)
            o_bias = layer.o_bias if self._adds_o_bias else None
            hidden = reduce(F.linear(attn.reshape(n, s.q_size), layer.o, o_bias))
            hidden, residual = ops.add_rms_norm(hidden, residual, layer.post_norm, s.rms_eps)
            hidden = F.linear(ops.silu_and_mul(F.linear(hidden, layer.gate_up)), layer.down)
            hidden = reduce(hidden)
        rows = step.logits_rows
        hidden, _ = ops.add_rms_norm(hidden[rows], residual[rows], w.final_norm, s.rms_eps)
        return F.linear(hidden, w.lm_head)

    def _embed(self, ids: Tensor) -> Tensor:
        """Embedding rows; tensor-parallel: each rank looks up the ids in its vocabulary
        rows (zeros for the others), and the sum over ranks has every row exactly."""
        if self.tp is None:
            return F.embedding(ids, self.weights.embed)
        lo, hi = self.tp.shard.vocab_rows
        local = ids - lo
        outside = (local < 0) | (local >= hi - lo)
        rows = F.embedding(local.masked_fill(outside, 0), self.weights.embed)
        return self.tp.all_reduce(rows.masked_fill_(outside.unsqueeze(-1), 0))


def _unchanged(x: Tensor) -> Tensor:
    return x
