"""Triton kernels for the native engine's elementwise work on CUDA, one launch each.

- add + RMSNorm: the residual add and the norm of a decoder layer in one pass (the new
  residual is written in place);
- rotary embedding + KV-cache write: splits the fused qkv output, applies Qwen3's
  per-head q/k norms if the model has them, rotates q and k, writes k and v to their
  cache slots and q to a packed output;
- SiLU-and-mul, or GELU-and-mul (Gemma's gate), of the fused gate_up output;
- the norms' styles: Llama's, and OLMo 2's and Gemma's (in float32, Gemma's weight
  offset by 1).

Each rounds to the model dtype where `rayrl.rollout.native.ops.TorchOps` (and so
transformers) does, and is tested against it. ``TRITON_INTERPRET=1`` runs them on CPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

__all__ = ["TritonOps"]

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter


@triton.jit
def _rms_norm_kernel(
    X,
    R,
    W,
    Y,
    stride_x,
    stride_r,
    stride_y,
    n_cols,
    eps,
    offset,
    HAS_RESIDUAL: tl.constexpr,
    IN_FLOAT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    dtype = x.dtype
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(dtype)
        tl.store(R + row * stride_r + cols, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=0) / n_cols
    h = h * (1.0 / tl.sqrt(var + eps))
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if IN_FLOAT:  # noqa: SIM108 - a constexpr branch. OLMo 2, Gemma: normed * (weight + offset) in float32
        y = h * (w + offset)
    else:  # Llama's: (weight + offset) * normed, each rounded to the model dtype first
        y = _round(w + offset, dtype) * _round(h, dtype)
    tl.store(Y + row * stride_y + cols, y.to(dtype), mask=mask)


@triton.jit
def _round(x, dtype: tl.constexpr):
    return x.to(dtype).to(tl.float32)


@triton.jit
def _rotate(x1, x2, c1, c2, s1, s2, dtype: tl.constexpr):
    """x * cos + rotate_half(x) * sin on [heads, D/2] halves, rounding as eager torch does."""
    y1 = _round(_round(x1 * c1, dtype) + _round(-x2 * s1, dtype), dtype)
    y2 = _round(_round(x2 * c2, dtype) + _round(x1 * s2, dtype), dtype)
    return y1, y2


@triton.jit
def _head_norm(x1, x2, W, offs, eps, D: tl.constexpr, dtype: tl.constexpr):
    """Qwen3's RMSNorm over each head's D values (rows of the [heads, D/2] halves)."""
    half: tl.constexpr = D // 2
    inv = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)
    w1 = tl.load(W + offs).to(tl.float32)
    w2 = tl.load(W + half + offs).to(tl.float32)
    x1 = _round(w1[None, :] * _round(x1 * inv[:, None], dtype), dtype)
    x2 = _round(w2[None, :] * _round(x2 * inv[:, None], dtype), dtype)
    return x1, x2


@triton.jit
def _rope_store_kernel(
    QKV,
    POS,
    COS,
    SIN,
    QOUT,
    KC,
    VC,
    SLOTS,
    QNW,
    KNW,
    stride_qkv,
    stride_qo_t,
    stride_qo_h,
    stride_c_slot,
    stride_c_head,
    eps,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    H_PAD: tl.constexpr,
    KV_PAD: tl.constexpr,
    D: tl.constexpr,
    HAS_QK_NORM: tl.constexpr,
):
    """One token: every q, k and v head of it."""
    t = tl.program_id(0).to(tl.int64)
    half: tl.constexpr = D // 2
    offs = tl.arange(0, half)
    dtype = QOUT.dtype.element_ty
    pos = tl.load(POS + t)
    slot = tl.load(SLOTS + t)
    c1 = _round(tl.load(COS + pos * D + offs), dtype)[None, :]
    c2 = _round(tl.load(COS + pos * D + half + offs), dtype)[None, :]
    s1 = _round(tl.load(SIN + pos * D + offs), dtype)[None, :]
    s2 = _round(tl.load(SIN + pos * D + half + offs), dtype)[None, :]
    row = QKV + t * stride_qkv

    hq = tl.arange(0, H_PAD)
    qm = (hq < HEADS)[:, None]
    src = row + hq[:, None] * D + offs[None, :]
    x1 = tl.load(src, mask=qm, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=qm, other=0.0).to(tl.float32)
    if HAS_QK_NORM:
        x1, x2 = _head_norm(x1, x2, QNW, offs, eps, D, dtype)
    y1, y2 = _rotate(x1, x2, c1, c2, s1, s2, dtype)
    dst = QOUT + t * stride_qo_t + hq[:, None] * stride_qo_h + offs[None, :]
    tl.store(dst, y1.to(dtype), mask=qm)
    tl.store(dst + half, y2.to(dtype), mask=qm)

    if slot >= 0:  # (names differ from the q part: a branch may not retype a variable)
        hk = tl.arange(0, KV_PAD)
        km = (hk < KV_HEADS)[:, None]
        k_src = row + (HEADS + hk)[:, None] * D + offs[None, :]
        k1 = tl.load(k_src, mask=km, other=0.0).to(tl.float32)
        k2 = tl.load(k_src + half, mask=km, other=0.0).to(tl.float32)
        if HAS_QK_NORM:
            k1, k2 = _head_norm(k1, k2, KNW, offs, eps, D, dtype)
        r1, r2 = _rotate(k1, k2, c1, c2, s1, s2, dtype)
        cache_at = slot * stride_c_slot + hk[:, None] * stride_c_head + offs[None, :]
        tl.store(KC + cache_at, r1.to(dtype), mask=km)
        tl.store(KC + cache_at + half, r2.to(dtype), mask=km)
        v_src = row + (HEADS + KV_HEADS + hk)[:, None] * D + offs[None, :]
        tl.store(VC + cache_at, tl.load(v_src, mask=km), mask=km)
        tl.store(VC + cache_at + half, tl.load(v_src + half, mask=km), mask=km)


@triton.jit
def _silu_mul_kernel(GU, OUT, stride_gu, stride_out, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(GU + row * stride_gu + cols, mask=mask, other=0.0)
    up = tl.load(GU + row * stride_gu + n_cols + cols, mask=mask, other=0.0)
    dtype = gate.dtype
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    tl.store(OUT + row * stride_out + cols, (act * up.to(tl.float32)).to(dtype), mask=mask)


@triton.jit
def _one_plus_tanh(y, LIBDEVICE: tl.constexpr):
    """1 + tanh(y): with CUDA's tanh (as torch's kernels take it) on a GPU; in the CPU
    interpreter, which has no libdevice, as 2 sigmoid(2y) (no cancellation near -1)."""
    if LIBDEVICE:
        return 1.0 + libdevice.tanh(y)
    return 2.0 / (1.0 + tl.exp(-2.0 * y))


@triton.jit
def _gelu_mul_kernel(
    GU,
    OUT,
    stride_gu,
    stride_out,
    n_cols,
    TANH: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(GU + row * stride_gu + cols, mask=mask, other=0.0)
    up = tl.load(GU + row * stride_gu + n_cols + cols, mask=mask, other=0.0)
    dtype = gate.dtype
    g = gate.to(tl.float32)
    if TANH:  # torch's tanh approximation, in float32 as torch computes it
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        act = 0.5 * g * _one_plus_tanh(inner, LIBDEVICE)
    else:
        act = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
    act = act.to(dtype).to(tl.float32)
    tl.store(OUT + row * stride_out + cols, (act * up.to(tl.float32)).to(dtype), mask=mask)


class TritonOps:
    """The `Ops` of `TorchOps`, each operation as one Triton kernel."""

    name = "triton"

    @staticmethod
    def rms_norm(
        x: Tensor, weight: Tensor, eps: float, offset: float = 0.0, in_float: bool = False
    ) -> Tensor:
        return _norm(x, None, weight, eps, offset, in_float)

    def add_rms_norm(
        self,
        x: Tensor,
        residual: Tensor,
        weight: Tensor,
        eps: float,
        offset: float = 0.0,
        in_float: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """Like `TorchOps.add_rms_norm`, but ``residual`` is updated in place and returned."""
        return _norm(x, residual, weight, eps, offset, in_float), residual

    def rope_and_store(
        self, qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, shape, qk_norm=None
    ) -> Tensor:
        heads, kv_heads, head_dim = shape
        n = qkv.shape[0]
        q = torch.empty(n, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
        if n == 0:
            return q
        kc = k_cache.view(-1, kv_heads, head_dim)
        vc = v_cache.view(-1, kv_heads, head_dim)
        qn, kn, eps = qk_norm if qk_norm is not None else (q, q, 0.0)
        _rope_store_kernel[(n,)](
            qkv,
            positions,
            cos,
            sin,
            q,
            kc,
            vc,
            slot_mapping,
            qn,
            kn,
            qkv.stride(0),
            q.stride(0),
            q.stride(1),
            kc.stride(0),
            kc.stride(1),
            eps,
            HEADS=heads,
            KV_HEADS=kv_heads,
            H_PAD=triton.next_power_of_2(heads),
            KV_PAD=triton.next_power_of_2(kv_heads),
            D=head_dim,
            HAS_QK_NORM=qk_norm is not None,
        )
        return q

    @staticmethod
    def silu_and_mul(gate_up: Tensor) -> Tensor:
        n, cols = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(n, cols, dtype=gate_up.dtype, device=gate_up.device)
        if n:
            block = 1024
            _silu_mul_kernel[(n, triton.cdiv(cols, block))](
                gate_up, out, gate_up.stride(0), out.stride(0), cols, BLOCK=block
            )
        return out

    @staticmethod
    def gelu_and_mul(gate_up: Tensor, approximate: str = "tanh") -> Tensor:
        """Like `TorchOps.gelu_and_mul` (Gemma's gate), one kernel."""
        n, cols = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(n, cols, dtype=gate_up.dtype, device=gate_up.device)
        if n:
            block = 1024
            _gelu_mul_kernel[(n, triton.cdiv(cols, block))](
                gate_up,
                out,
                gate_up.stride(0),
                out.stride(0),
                cols,
                TANH=approximate == "tanh",
                LIBDEVICE=not INTERPRETED,
                BLOCK=block,
            )
        return out


def _norm(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor,
    eps: float,
    offset: float = 0.0,
    in_float: bool = False,
) -> Tensor:
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    out = torch.empty_like(x2)
    r2 = residual.view(-1, shape[-1]) if residual is not None else x2
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            r2,
            weight,
            out,
            x2.stride(0),
            r2.stride(0),
            out.stride(0),
            shape[-1],
            eps,
            float(offset),
            HAS_RESIDUAL=residual is not None,
            IN_FLOAT=bool(in_float),
            BLOCK=triton.next_power_of_2(shape[-1]),
        )
    return out.view(shape)
