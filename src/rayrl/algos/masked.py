"""Masked reductions over padded [batch, response_len] tensors.

A mask holds 1 (or True) for real response tokens and 0 for padding. Padded positions
may hold anything, even NaN or inf: every function here selects with ``torch.where``
rather than multiplying by the mask, so garbage in padding never leaks into a result.
An empty mask gives a mean of 0, not NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "token_and_seq_counts",
]


def _select(values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Values with padding zeroed, and the mask as the values' dtype."""
    weight = mask.to(values.dtype)
    return torch.where(mask.bool(), values, torch.zeros_like(values)), weight


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``values`` over positions where ``mask`` is set (all dims if ``dim`` is None)."""
    selected, weight = _select(values, mask)
    selected = selected * weight
    return selected.sum() if dim is None else selected.sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean over masked positions; 0 where the mask is empty."""
    total = masked_sum(values, mask, dim)
    count = mask.to(values.dtype).sum() if dim is None else mask.to(values.dtype).sum(dim=dim)
    return total / count.clamp(min=1e-8)


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance over all masked positions (Bessel-corrected when ``unbiased``).

    With fewer than two valid positions the unbiased variance is defined as 0.
    """
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.to(values.dtype).sum()
        var = torch.where(count > 1, var * count / (count - 1).clamp(min=1e-8), 0.0 * var)
    return var


def masked_whiten(
    values: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> Tensor:
    """Normalise ``values`` to unit variance over the masked positions of the whole tensor.

    With ``shift_mean`` the result also has zero mean; without it the mean is kept.
    Padded positions are set to 0.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))


def token_and_seq_counts(response_mask: Tensor) -> tuple[int, int]:
    """Number of valid tokens and of sequences with at least one valid token.

    These are the local shares of the ``global_token_count`` / ``global_seq_count``
    that loss aggregation needs (see :mod:`rayrl.algos.aggregation`); sum them over all
    micro-batches and data-parallel ranks of a mini-batch.
    """
    per_seq = response_mask.to(torch.float64).sum(dim=-1)
    return int(per_seq.sum().item()), int((per_seq > 0).sum().item())
