"""Attention over the paged KV cache, in plain torch (CPU, and the reference).

The cache of one layer is ``[blocks, block_size, kv_heads, head_dim]``; a sequence's
token at position p lives in block ``block_table[row, p // block_size]`` at offset
``p % block_size``. Decode gathers each sequence's live context and runs one batched
``scaled_dot_product_attention`` with grouped KV heads (``enable_gqa``); prefill runs one
causal attention per sequence over its cached prefix plus the new chunk.

`make_attention("triton")` returns the Triton kernels of
`rayrl.rollout.native.triton_attention` (GQA-aware split-KV decode, paged
prefill), used on CUDA; `choose_kernels` resolves the engine's ``kernels="auto"``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from rayrl.rollout.native.step import StepInput

__all__ = ["TorchAttention", "choose_kernels", "make_attention"]


class TorchAttention:
    """Paged attention with torch ops: exact, simple, not fast."""

    name = "torch"

    def __call__(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, step: StepInput, scale: float):
        if step.decode:
            return self.decode(q, k_cache, v_cache, step, scale)
        return self.prefill(q, k_cache, v_cache, step, scale)

    @staticmethod
    def decode(
        q: Tensor, k_cache: Tensor, v_cache: Tensor, step: StepInput, scale: float
    ) -> Tensor:
        """q [B, H, D], one query per sequence at the end of its context -> [B, H, D]."""
        n, heads, dim = q.shape
        block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
        lens = step.seq_lens[:n].long()
        width = max(int(lens.max().item()) if n else 1, 1)
        pos = torch.arange(width, device=q.device)
        tables = step.block_table[step.seq_rows[:n].long()].long()
        slots = tables[:, pos // block_size] * block_size + pos % block_size
        live = pos.unsqueeze(0) < lens.unsqueeze(1)
        # Positions past a row's length read whatever the cache holds there (never written,
        # maybe NaN): zero them, since a masked NaN value still poisons the weighted sum.
        dead = ~live[:, :, None, None]
        keys = k_cache.view(-1, kv_heads, dim)[slots].masked_fill(dead, 0).transpose(1, 2)
        values = v_cache.view(-1, kv_heads, dim)[slots].masked_fill(dead, 0).transpose(1, 2)
        live = live | (pos == 0)  # an empty (padding) row attends to a zero vector
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),
            keys,
            values,
            attn_mask=live[:, None, None, :],
            scale=scale,
            enable_gqa=heads != kv_heads,
        )
        return out.squeeze(2)

    @staticmethod
    def prefill(
        q: Tensor, k_cache: Tensor, v_cache: Tensor, step: StepInput, scale: float
    ) -> Tensor:
        """q [T, H, D], chunks of several sequences; causal over prefix + chunk -> [T, H, D]."""
        block_size, kv_heads, dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
        heads = q.shape[1]
        out = torch.empty_like(q)
        starts, lens = step.q_start_host, step.seq_lens_host
        rows = step.seq_rows_host if step.seq_rows_host is not None else step.seq_rows.tolist()
        for i, row in enumerate(rows):
            a, b, total = starts[i], starts[i + 1], lens[i]
            pos = torch.arange(total, device=q.device)
            blocks = step.block_table[row, : (total + block_size - 1) // block_size].long()
            slots = blocks[pos // block_size] * block_size + pos % block_size
            keys = k_cache.view(-1, kv_heads, dim)[slots].transpose(0, 1)  # [KVH, L, D]
            values = v_cache.view(-1, kv_heads, dim)[slots].transpose(0, 1)
            queries = q[a:b].transpose(0, 1)  # [H, Lq, D]
            if b - a == total:
                mask, causal = None, True
            else:  # query i sits at position total - (b - a) + i
                q_pos = torch.arange(total - (b - a), total, device=q.device)
                mask, causal = pos.unsqueeze(0) <= q_pos.unsqueeze(1), False
            out[a:b] = F.scaled_dot_product_attention(
                queries,
                keys,
                values,
                attn_mask=mask,
                is_causal=causal,
                scale=scale,
                enable_gqa=heads != kv_heads,
            ).transpose(0, 1)
        return out


def make_attention(kernels: str):
    """`TritonAttention` for ``kernels="triton"``, `TorchAttention` for ``"torch"``."""
    if kernels == "triton":
        from rayrl.rollout.native.triton_attention import TritonAttention

        return TritonAttention()
    return TorchAttention()


def choose_kernels(kernels: str, device: torch.device, head_dim: int) -> str:
    """Resolve ``"auto"``: Triton on CUDA when it imports and the head size suits it
    (a power of two, at least 16), torch otherwise."""
    if kernels not in ("auto", "torch", "triton"):
        raise ValueError(
            f"native rollout engine: kernels={kernels!r} is not auto, torch or triton."
        )
    if kernels != "auto":
        return kernels
    if torch.device(device).type != "cuda" or head_dim < 16 or head_dim & (head_dim - 1):
        return "torch"
    try:
        import triton  # noqa: F401
    except ImportError:  # pragma: no cover - CUDA without Triton
        return "torch"
    return "triton"
