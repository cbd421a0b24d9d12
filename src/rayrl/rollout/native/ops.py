"""The native engine's per-layer operations, as plain torch (CPU, and the reference).

Every operation rounds where transformers' modeling code rounds (an RMSNorm computes in
float32 and returns ``weight * normed.to(dtype)``; rotary embedding multiplies and adds
in the model dtype), so that on CPU in float32 the native forward agrees with
transformers to the last few bits and greedy decoding picks the same tokens.

`TorchOps` is the CPU implementation and the reference the Triton kernels
(`rayrl.rollout.native.triton_ops`) are checked against; the model
(`rayrl.rollout.native.model.make_ops`) picks one by the engine's ``kernels``
setting.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["TorchOps"]


class TorchOps:
    """Fused-by-name operations, each in a few torch calls."""

    name = "torch"

    @staticmethod
    def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(dtype)

    def add_rms_norm(
        self, x: Tensor, residual: Tensor, weight: Tensor, eps: float
    ) -> tuple[Tensor, Tensor]:
        """``(rms_norm(residual + x), residual + x)``: the decoder's residual add and norm."""
        residual = residual + x
        return self.rms_norm(residual, weight, eps), residual

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
        q = q * c + _rotate_half(q) * s
        k = k * c + _rotate_half(k) * s
        keep = slot_mapping >= 0
        slots = slot_mapping[keep]
        k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, k[keep])
        v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, v[keep])
        return q

    @staticmethod
    def silu_and_mul(gate_up: Tensor) -> Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
