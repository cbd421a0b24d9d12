"""Attention over the paged KV cache, in plain torch (CPU, and the reference).

The cache of one layer is ``[blocks, block_size, kv_heads, head_dim]``; a sequence's
token at position p lives in block ``block_table[row, p // block_size]`` at offset
``p % block_size``. Decode gathers each sequence's live context and runs one batched
``scaled_dot_product_attention`` with grouped KV heads (``enable_gqa``); prefill runs one
causal attention per sequence over its cached prefix plus the new chunk. A layer with a
sliding window (``window``: a query sees its last ``window`` positions, itself included,
as transformers' sliding mask) masks the older keys; soft-capped scores (``softcap``:
``cap * tanh(s / cap)``, Gemma 2) are computed as transformers' eager attention does
(scores, cap, mask, float32 softmax). Both default off, and then the code is the same.

`make_attention("triton")` returns the Triton kernels of
`rayrl.rollout.native.triton_attention` (GQA-aware split-KV decode, paged
prefill), used on CUDA; `choose_kernels` resolves the engine's ``kernels="auto"``, and
`triton_gaps` names what a model needs that the Triton kernels do not do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from rayrl.rollout.native.spec import HINT, ModelSpec
from rayrl.rollout.native.step import StepInput

__all__ = ["TorchAttention", "choose_kernels", "make_attention", "triton_gaps"]


class TorchAttention:
    """Paged attention with torch ops: exact, simple, not fast."""

    name = "torch"

    def __call__(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        step: StepInput,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ):
        if step.decode:
            return self.decode(q, k_cache, v_cache, step, scale, window, softcap)
        return self.prefill(q, k_cache, v_cache, step, scale, window, softcap)

    @staticmethod
    def decode(
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        step: StepInput,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
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
        if window:  # and an empty (padding) row attends to a zero vector
            empty = (pos == 0) & (lens == 0).unsqueeze(1)
            live = (live & (pos.unsqueeze(0) >= lens.unsqueeze(1) - window)) | empty
        else:
            live = live | (pos == 0)  # an empty (padding) row attends to a zero vector
        if softcap:
            out = _capped(q.unsqueeze(2), keys, values, live[:, None, None, :], scale, softcap)
            return out.squeeze(2)
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
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        step: StepInput,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> Tensor:
        """q [T, H, D], chunks of several sequences; causal over prefix + chunk -> [T, H, D]."""
        block_size, kv_heads, dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
        heads = q.shape[1]
        out = torch.empty_like(q)
        starts, lens = step.q_start_host, step.seq_lens_host
        if starts is None or lens is None:
            raise ValueError("a prefill step needs its host lists (q_start_host, seq_lens_host)")
        rows = step.seq_rows_host if step.seq_rows_host is not None else step.seq_rows.tolist()
        for i, row in enumerate(rows):
            a, b, total = starts[i], starts[i + 1], lens[i]
            pos = torch.arange(total, device=q.device)
            blocks = step.block_table[row, : (total + block_size - 1) // block_size].long()
            slots = blocks[pos // block_size] * block_size + pos % block_size
            keys = k_cache.view(-1, kv_heads, dim)[slots].transpose(0, 1)  # [KVH, L, D]
            values = v_cache.view(-1, kv_heads, dim)[slots].transpose(0, 1)
            queries = q[a:b].transpose(0, 1)  # [H, Lq, D]
            if b - a == total and not (window or softcap):
                mask, causal = None, True
            else:  # query i sits at position total - (b - a) + i
                q_pos = torch.arange(total - (b - a), total, device=q.device)
                mask, causal = _visible(pos, q_pos, window), False
            if softcap:
                out[a:b] = _capped(queries, keys, values, mask, scale, softcap).transpose(0, 1)
                continue
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


def _visible(pos: Tensor, q_pos: Tensor, window: int) -> Tensor:
    """``[queries, keys]``: key position ``pos`` is visible to query position ``q_pos``
    (causal; within the last ``window`` positions when ``window``)."""
    mask = pos.unsqueeze(0) <= q_pos.unsqueeze(1)
    if window:
        mask &= pos.unsqueeze(0) > q_pos.unsqueeze(1) - window
    return mask


def _capped(
    q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float, softcap: float
) -> Tensor:
    """Soft-capped attention as transformers' eager path computes it: ``q [..., H, Lq, D]``,
    ``keys``/``values`` ``[..., KVH, L, D]``, ``mask`` (True: visible) -> ``[..., H, Lq, D]``."""
    group = q.shape[-3] // keys.shape[-3]
    keys = keys.repeat_interleave(group, dim=-3)
    values = values.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, values)


def triton_gaps(spec: ModelSpec, max_len: int) -> str | None:
    """What ``spec``'s model needs that the Triton kernels (CUDA) do not do, for sequences
    of at most ``max_len`` tokens, as a sentence with the way out; None: nothing."""
    gaps = []
    windows = sorted({w for w in spec.windows if 0 < w < max_len})
    if windows:
        gaps.append(f"sliding-window attention (windows {windows} < {max_len} positions)")
    if spec.attn_softcap:
        gaps.append(f"soft-capped attention scores (cap {spec.attn_softcap:g})")
    if spec.rotary_dim and spec.rotary_dim != spec.head_dim:
        gaps.append(f"rotary embedding over {spec.rotary_dim} of the {spec.head_dim} head dims")
    if not gaps:
        return None
    return (
        f"native rollout engine: this {spec.model_type} model needs {', '.join(gaps)}, which "
        f"its Triton kernels (CUDA) do not implement (its torch kernels, on CPU, do); {HINT} "
        "(rollout.name=auto picks it on a GPU)."
    )


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
