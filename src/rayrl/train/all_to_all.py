"""A differentiable all-to-all with uneven splits, for expert parallelism.

`all_to_all(x, out_splits, in_splits, group)` sends ``in_splits[r]`` consecutive rows of
``x`` to rank ``r`` of ``group`` and returns the rows every rank sent to this one, rank
by rank (``out_splits[r]`` from rank ``r``), with
``torch.distributed.all_to_all_single``. Its backward is the reverse exchange: the
gradient of each received row goes back to the rank and position it came from, so the
splits swap roles.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["AllToAll", "all_to_all"]


def _exchange(x: Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class AllToAll(torch.autograd.Function):
    """Rows of ``x`` exchanged between the ranks of ``group`` (module docstring)."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, out_splits: list[int], in_splits: list[int], group: Any
    ) -> Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group), None, None, None


def all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> Tensor:
    """``x``'s rows exchanged over ``group``: ``in_splits[r]`` sent to rank ``r``,
    ``out_splits[r]`` received from it; differentiable."""
    return AllToAll.apply(x, out_splits, in_splits, group)
