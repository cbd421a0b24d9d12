"""The native engine's per-layer operations, as plain torch (CPU, and the reference).

Every operation rounds where transformers' modeling code rounds (an RMSNorm computes in
float32 and returns ``weight * normed.to(dtype)``; rotary embedding multiplies and adds
in the model dtype), so that on CPU in float32 the native forward agrees with
transformers to the last few bits and greedy decoding picks the same tokens.

The layer variants of other families are here too, each as its transformers family
computes it: Gemma's and OLMo 2's norms (`rms_norm` with ``offset`` / ``in_float``: the
weight applied to the float32 values, rounded once), rotary embedding over part of a head
(Phi-4-mini: the tables are narrower than the head), GELU-gated MLPs (`gelu_and_mul`).

`TorchOps` is the CPU implementation and the reference the Triton kernels
(`rayrl.rollout.native.triton_ops`) are checked against; the model
(`rayrl.rollout.native.model.make_ops`) picks one by the engine's ``kernels``
setting. Both are `Ops`: the operations the model calls on the kernels it picked (the
styled norms are `TorchOps`' alone, which the model calls itself).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["Ops", "TorchOps"]


class Ops(Protocol):
    """The operations a set of kernels implements (`TorchOps`, `TritonOps`): RMSNorm in
    Llama's style or, with ``in_float`` and an ``offset``, OLMo 2's and Gemma's,
    rotary-and-store, SiLU-and-mul and GELU-and-mul."""

    name: str

    def rms_norm(
        self, x: Tensor, weight: Tensor, eps: float, offset: float = 0.0, in_float: bool = False
    ) -> Tensor: ...

    def add_rms_norm(
        self,
        x: Tensor,
        residual: Tensor,
        weight: Tensor,
        eps: float,
        offset: float = 0.0,
        in_float: bool = False,
    ) -> tuple[Tensor, Tensor]: ...

    def rope_and_store(
        self,
        qkv: Tensor,
        positions: Tensor,
        cos: Tensor,
        sin: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        slot_mapping: Tensor,
        shape: tuple[int, int, int],
        qk_norm: tuple[Tensor, Tensor, float] | None = None,
    ) -> Tensor: ...

    def silu_and_mul(self, gate_up: Tensor) -> Tensor: ...

    def gelu_and_mul(self, gate_up: Tensor, approximate: str = "tanh") -> Tensor: ...


class TorchOps:
    """Fused-by-name operations, each in a few torch calls."""

    name = "torch"

    @staticmethod
    def rms_norm(
        x: Tensor, weight: Tensor, eps: float, offset: float = 0.0, in_float: bool = False
    ) -> Tensor:
        """Llama's RMSNorm: ``weight * normed.to(dtype)``; with ``in_float`` (OLMo 2, and
        Gemma with ``offset`` 1) ``(normed * (weight.float() + offset)).to(dtype)``."""
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        if in_float:
            return (h * (weight.float() + offset)).to(dtype)
        return (weight + offset if offset else weight) * h.to(dtype)

    def add_rms_norm(
        self,
        x: Tensor,
        residual: Tensor,
        weight: Tensor,
        eps: float,
        offset: float = 0.0,
        in_float: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """``(rms_norm(residual + x), residual + x)``: the decoder's residual add and norm
        (`rms_norm`'s ``offset`` and ``in_float`` style)."""
        residual = residual + x
        return self.rms_norm(residual, weight, eps, offset, in_float), residual

    def rope_and_store(
        self,
        qkv: Tensor,
        positions: Tensor,
        cos: Tensor,
        sin: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        slot_mapping: Tensor,
        shape: tuple[int, int, int],
        qk_norm: tuple[Tensor, Tensor, float] | None = None,
    ) -> Tensor:
        """Split ``qkv`` [T, (H + 2 KVH) D], rotate q and k, write k and v to the cache.

        Args:
            shape: (heads, kv_heads, head_dim).
            slot_mapping: [T] cache slot (block * block_size + offset) of each token; -1
                skips the write (padding rows).
            qk_norm: (q_norm weight, k_norm weight, eps) for Qwen3's per-head norms.

        Returns:
            The rotated queries [T, H, D].
        """
        heads, kv_heads, head_dim = shape
        n = qkv.shape[0]
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        q = qkv[:, :q_size].view(n, heads, head_dim)
        k = qkv[:, q_size : q_size + kv_size].view(n, kv_heads, head_dim)
        v = qkv[:, q_size + kv_size :].view(n, kv_heads, head_dim)
        if qk_norm is not None:
            q, k = (
                self.rms_norm(q, qk_norm[0], qk_norm[2]),
                self.rms_norm(k, qk_norm[1], qk_norm[2]),
            )
        c = cos[positions].to(qkv.dtype).unsqueeze(1)
        s = sin[positions].to(qkv.dtype).unsqueeze(1)
        q, k = _rotate(q, c, s), _rotate(k, c, s)
        keep = slot_mapping >= 0
        slots = slot_mapping[keep]
        k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, k[keep])
        v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, v[keep])
        return q

    @staticmethod
    def silu_and_mul(gate_up: Tensor) -> Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def gelu_and_mul(gate_up: Tensor, approximate: str = "tanh") -> Tensor:
        """GELU-gated MLP (Gemma): ``gelu(gate) * up``; ``approximate`` "tanh" or "none"."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate=approximate) * up


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x * cos + rotate_half(x) * sin`` over the tables' width; a partial rotary table
    (narrower than the head) leaves the head's last dims as they are."""
    width = cos.shape[-1]
    if width == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    turned, kept = x[..., :width], x[..., width:]
    return torch.cat((turned * cos + _rotate_half(turned) * sin, kept), dim=-1)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
