"""Paged attention kernels in Triton: GQA-aware split-KV decode, and chunked prefill.

**Decode** (one query token per sequence): a program handles one sequence, one KV head
and one split of its live context. It loads the group of query heads that share the
KV head as one ``[group, head_dim]`` tile, so each key and value is read from memory
once for all of them (no repeat of KV heads), walks its part of the context through
the block table ``BLOCK_N`` tokens at a time with an online softmax, and writes its
partial output and log-sum-exp. A second small kernel merges the splits. Splitting the
context keeps the GPU busy when there are few sequences; with many, one split is used
and the first kernel writes the output directly. The number of splits is fixed per
batch size, so the launch is the same at every step and can be captured in a CUDA graph.

**Prefill** (chunks of several tokens per sequence): a program handles ``BLOCK_M``
query tokens of one sequence for one query head, and attends causally over the
sequence's cached prefix and the chunk itself (already written to the cache).

`TorchAttention` (`rayrl.rollout.native.attention`) is the reference both are
tested against; ``TRITON_INTERPRET=1`` runs them on CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from rayrl.rollout.native.step import PREFILL_TILE, StepInput

__all__ = ["DECODE_CONFIG", "TritonAttention", "decode_splits"]

_SMS = 132  # streaming multiprocessors of an H100/H200; only sizes the split heuristic
# Launch settings of the decode kernel (tokens per iteration, warps, pipeline stages):
# the fastest of the settings `bench/rollout.py --tune-decode` swept on an H200
# (docs/benchmarks.md, rollout run 3).
DECODE_CONFIG = {"BLOCK_N": 128, "num_warps": 4, "num_stages": 2}


def decode_splits(batch: int, kv_heads: int) -> int:
    """Context splits per (sequence, KV head): enough programs to fill the GPU twice."""
    return max(1, min(16, -(-2 * _SMS // max(1, batch * kv_heads))))


@triton.jit
def _decode_kernel(
    Q,
    K,
    V,
    BT,
    ROWS,
    LENS,
    OUT,
    LSE,
    scale,
    stride_q_t,
    stride_q_h,
    stride_k_b,
    stride_k_s,
    stride_k_h,
    stride_bt,
    stride_o_t,
    stride_o_s,
    stride_o_h,
    stride_l_t,
    stride_l_s,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(LENS + seq)
    row = tl.load(ROWS + seq).to(tl.int64)
    tiles = tl.cdiv(length, BLOCK_N)
    per_split = tl.cdiv(tiles, SPLITS)
    start = split * per_split * BLOCK_N
    end = tl.minimum(start + per_split * BLOCK_N, length)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D)
    heads = kvh * GROUP + g
    q = tl.load(
        Q + seq * stride_q_t + heads[:, None] * stride_q_h + d[None, :],
        mask=g[:, None] < GROUP,
        other=0.0,
    )
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    acc_l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        valid = n < end
        block = tl.load(BT + row * stride_bt + n // BS, mask=valid, other=0).to(tl.int64)
        offset = block * stride_k_b + (n % BS) * stride_k_s + kvh * stride_k_h
        k = tl.load(K + offset[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        acc_l = acc_l * alpha + tl.sum(p, axis=1)
        v = tl.load(V + offset[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    empty = acc_l == 0.0
    out = acc / tl.where(empty, 1.0, acc_l)[:, None]
    o_ptr = OUT + seq * stride_o_t + split * stride_o_s + heads[:, None] * stride_o_h + d[None, :]
    tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=g[:, None] < GROUP)
    if SPLITS > 1:
        lse = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, acc_l)))
        tl.store(LSE + seq * stride_l_t + split * stride_l_s + heads, lse, mask=g < GROUP)


@triton.jit
def _merge_kernel(
    PART,
    LSE,
    OUT,
    stride_p_t,
    stride_p_s,
    stride_p_h,
    stride_l_t,
    stride_l_s,
    stride_o_t,
    stride_o_h,
    SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    D: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D)
    live = s < SPLITS
    lse = tl.load(LSE + seq * stride_l_t + s * stride_l_s + h, mask=live, other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp(lse - top)
    part = tl.load(
        PART + seq * stride_p_t + s[:, None] * stride_p_s + h * stride_p_h + d[None, :],
        mask=live[:, None],
        other=0.0,
    ).to(tl.float32)
    total = tl.sum(w, axis=0)
    out = tl.sum(part * w[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(OUT + seq * stride_o_t + h * stride_o_h + d, out.to(OUT.dtype.element_ty))


@triton.jit
def _prefill_kernel(
    Q,
    K,
    V,
    OUT,
    BT,
    ROWS,
    LENS,
    QSTART,
    TILES,
    scale,
    stride_q_t,
    stride_q_h,
    stride_k_b,
    stride_k_s,
    stride_k_h,
    stride_bt,
    stride_o_t,
    stride_o_h,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    seq = tl.load(TILES + tile * 2).to(tl.int64)
    first = tl.load(TILES + tile * 2 + 1)
    q_lo = tl.load(QSTART + seq)
    q_len = tl.load(QSTART + seq + 1) - q_lo
    total = tl.load(LENS + seq)
    row = tl.load(ROWS + seq).to(tl.int64)
    prefix = total - q_len

    i = first + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    q_valid = i < q_len
    tokens = (q_lo + i).to(tl.int64)
    q = tl.load(
        Q + tokens[:, None] * stride_q_t + h * stride_q_h + d[None, :],
        mask=q_valid[:, None],
        other=0.0,
    )
    q_pos = prefix + i
    hi = tl.minimum(total, prefix + first + BLOCK_M)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    acc_l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for n0 in range(0, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        valid = n < hi
        block = tl.load(BT + row * stride_bt + n // BS, mask=valid, other=0).to(tl.int64)
        offset = block * stride_k_b + (n % BS) * stride_k_s + kvh * stride_k_h
        k = tl.load(K + offset[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(valid[None, :] & (n[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        acc_l = acc_l * alpha + tl.sum(p, axis=1)
        v = tl.load(V + offset[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    out = acc / acc_l[:, None]
    o_ptr = OUT + tokens[:, None] * stride_o_t + h * stride_o_h + d[None, :]
    tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=q_valid[:, None])


class TritonAttention:
    """Paged attention on CUDA with the kernels above."""

    name = "triton"

    def __init__(self, block_n: int = 64) -> None:
        self.block_n, self.block_m = block_n, PREFILL_TILE  # prefill tiles

    def __call__(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, step: StepInput, scale: float):
        if step.decode:
            return self.decode(q, k_cache, v_cache, step, scale)
        return self.prefill(q, k_cache, v_cache, step, scale)

    def decode(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        step: StepInput,
        scale: float,
        splits: int | None = None,
    ) -> Tensor:
        n, heads, dim = q.shape
        block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
        group = heads // kv_heads
        splits = splits or decode_splits(n, kv_heads)
        out = torch.empty_like(q)
        if n == 0:
            return out
        if splits == 1:
            part, lse = out.unsqueeze(1), out  # lse unused with one split
        else:
            part = torch.empty(n, splits, heads, dim, dtype=torch.float32, device=q.device)
            lse = torch.empty(n, splits, heads, dtype=torch.float32, device=q.device)
        table = step.block_table
        _decode_kernel[(n, kv_heads, splits)](
            q,
            k_cache,
            v_cache,
            table,
            step.seq_rows,
            step.seq_lens,
            part,
            lse,
            scale,
            q.stride(0),
            q.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            table.stride(0),
            part.stride(0),
            part.stride(1),
            part.stride(2),
            lse.stride(0),
            lse.stride(1) if splits > 1 else 0,
            GROUP=group,
            GROUP_PAD=max(16, triton.next_power_of_2(group)),
            D=dim,
            BS=block_size,
            SPLITS=splits,
            PRECISION=_precision(q),
            **DECODE_CONFIG,
        )
        if splits > 1:
            _merge_kernel[(n, heads)](
                part,
                lse,
                out,
                part.stride(0),
                part.stride(1),
                part.stride(2),
                lse.stride(0),
                lse.stride(1),
                out.stride(0),
                out.stride(1),
                SPLITS=splits,
                SPLITS_PAD=triton.next_power_of_2(splits),
                D=dim,
            )
        return out

    def prefill(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, step: StepInput, scale: float):
        n, heads, dim = q.shape
        block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
        out = torch.empty_like(q)
        tiles = step.tiles
        if n == 0 or tiles is None or tiles.shape[0] == 0:
            return out
        table = step.block_table
        _prefill_kernel[(tiles.shape[0], heads)](
            q,
            k_cache,
            v_cache,
            out,
            table,
            step.seq_rows,
            step.seq_lens,
            step.q_start,
            tiles,
            scale,
            q.stride(0),
            q.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            table.stride(0),
            out.stride(0),
            out.stride(1),
            GROUP=heads // kv_heads,
            D=dim,
            BS=block_size,
            BLOCK_M=self.block_m,
            BLOCK_N=self.block_n,
            PRECISION=_precision(q),
        )
        return out


def _precision(q: Tensor) -> str:
    """Exact float32 products for float32 models (tests), tensor cores otherwise."""
    return "ieee" if q.dtype == torch.float32 else "tf32"
