"""The FP8 rollout's input quantization on CUDA as one Triton kernel
(`rayrl.rollout.native.fp8`): each row's absolute maximum, its scale (``amax / 448``)
and the row in e4m3, in one launch instead of torch's five (abs, max, divide, clamp,
cast). The scale and the rounding are those of `fp8._quantized_input`, tested against
it on a GPU."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["quantize_rows"]

_BLOCK = 1024


@triton.jit
def _quantize_rows_kernel(X, Q, S, stride_x, stride_q, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_x + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), 1e-12), 448.0)  # as torch's /
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(tl.math.div_rn(x, scale), -448.0, 448.0)
        tl.store(Q + row * stride_q + cols, q.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + row, scale)


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """``x`` [rows, cols] (its last dim contiguous) in e4m3, and its float32 scale per
    row ``[rows, 1]``."""
    rows, cols = x.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        _quantize_rows_kernel[(rows,)](x, q, scale, x.stride(0), q.stride(0), cols, _BLOCK)
    return q, scale
