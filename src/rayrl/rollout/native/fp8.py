"""FP8 rollout (``actor_rollout_ref.rollout.quantization=fp8``): the native engine's
linear weights in float8 (e4m3), quantized at every weight sync.

Each of a dense layer's matrices (``qkv``, ``o``, ``gate_up``, ``down``) is held in
e4m3 with one float32 scale per output row (``amax / 448``), in place of its bf16
copy: a load or a weight sync writes its tensor straight into it, scaling and rounding
each row (a row's scale needs that row alone, so q, k and v, or gate and up, load one
at a time, and a tensor-parallel rank's rows are its own). A matmul quantizes its input per token the same way
(dynamic scales; one Triton kernel: `rayrl.rollout.native.triton_fp8`) and runs ``torch._scaled_mm`` with both scales on a card that has FP8
tensor cores (compute capability 8.9 or above: Ada, Hopper, Blackwell), in float32
accumulation, its output in the model's dtype. Elsewhere (a CPU, an older card, a
matrix whose sides are not multiples of 16) the same quantization is emulated: both
operands are rounded through e4m3 and scaled back, then multiplied in the model's
dtype, so a CPU run samples from the numerics an FP8 GPU run has, up to the order of
accumulation (an emulated matrix also keeps its dequantized copy in the model dtype).

The embeddings, the LM head, the norms, the routers and the experts of a mixture of
experts stay in the model's dtype. The quantized matrices are allocated once and
rewritten in place, so CUDA graphs captured over them stay valid across syncs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["FP8", "FP8_MAX", "Fp8Weight", "fp8_linear"]

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
_ROWS = 4096  # rows quantized at a time (bounds the float32 temporary)


def _scaled_mm_ok(device: torch.device, rows: int, cols: int) -> bool:
    if device.type != "cuda" or rows % 16 or cols % 16:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


@dataclass
class Fp8Weight:
    """One matrix ``[out, in]`` (or a range of its rows: `__getitem__`) in e4m3 with a
    float32 scale per output row; ``fast``: whether its matmul runs on FP8 tensor cores
    (else it is emulated, from ``dequantized``: module doc).

    It stands where the model-dtype matrix would in `NativeWeights`: a load copies a
    tensor into it (`copy_`: each row scaled and rounded), so the engine holds no
    model-dtype copy of a quantized matrix.
    """

    weight: Tensor
    scale: Tensor
    fast: bool
    dequantized: Tensor | None = None  # the emulated path's weight, in the model dtype

    @classmethod
    def empty(cls, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> Fp8Weight:
        """Uninitialised, on ``device``; emulated ones keep a ``dtype`` copy to multiply."""
        fast = _scaled_mm_ok(device, rows, cols)
        q = torch.empty(rows, cols, dtype=FP8, device=device)
        scale = torch.empty(rows, dtype=torch.float32, device=device)
        dequantized = None if fast else torch.empty(rows, cols, dtype=dtype, device=device)
        return cls(q, scale, fast, dequantized)

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def __getitem__(self, rows: slice) -> Fp8Weight:
        """Rows ``rows`` of this matrix, sharing its storage (q, k and v of a fused qkv)."""
        emulated = self.dequantized
        return Fp8Weight(
            self.weight[rows],
            self.scale[rows],
            self.fast,
            None if emulated is None else emulated[rows],
        )

    @torch.no_grad()
    def copy_(self, weight: Tensor) -> Fp8Weight:
        """Rewrite these rows, in place, from ``weight`` (any float dtype)."""
        for start in range(0, weight.shape[0], _ROWS):
            rows = weight[start : start + _ROWS].to(self.weight.device, torch.float32)
            scale = rows.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
            q = (rows / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            self.weight[start : start + _ROWS].copy_(q)
            self.scale[start : start + _ROWS].copy_(scale)
            if self.dequantized is not None:
                self.dequantized[start : start + _ROWS].copy_(q.float() * scale[:, None])
        return self

    def nbytes(self) -> int:
        emulated = self.dequantized
        extra = 0 if emulated is None else emulated.numel() * emulated.element_size()
        return self.weight.numel() + self.scale.numel() * 4 + extra


def _quantized_input(x: Tensor) -> tuple[Tensor, Tensor]:
    """``x`` [tokens, in] in e4m3, and its float32 scale per token ``[tokens, 1]``."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def _cuda_quantized_input(x: Tensor) -> tuple[Tensor, Tensor]:
    """`_quantized_input` as one Triton kernel (`rayrl.rollout.native.triton_fp8`)."""
    from rayrl.rollout.native.triton_fp8 import quantize_rows  # Triton: CUDA machines

    return quantize_rows(x.contiguous())


def fp8_linear(x: Tensor, w: Fp8Weight, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` with ``weight`` and ``x`` quantized (module doc)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if w.fast:
        xq, x_scale = _cuda_quantized_input(x2)
        out = torch._scaled_mm(
            xq, w.weight.t(), scale_a=x_scale, scale_b=w.scale[None], out_dtype=x.dtype
        )
    else:
        xq, x_scale = _quantized_input(x2)
        assert w.dequantized is not None  # allocated for every emulated weight
        out = F.linear((xq.float() * x_scale).to(x.dtype), w.dequantized)
    if bias is not None:
        out = out + bias
    return out.reshape(*shape[:-1], out.shape[-1])
