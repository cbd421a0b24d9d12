"""Gradient-norm clipping for the training engine, expert-parallel models included.

``torch.nn.utils.clip_grad_norm_`` combines the norms of DTensor gradients that live on
one device mesh. An expert-parallel model (`rayrl.train.expert_parallel`) has two: its
experts' gradients are sharded over the ``[edp, ep]`` mesh, every other gradient over
the flat FSDP mesh. Both shard each element onto exactly one rank, so the global norm
is the square root of the sum, over every rank, of the squares of its local shards:
`clip_grad_norm` computes that with one all-reduce and scales the gradients as
``clip_grad_norm_`` does (``min(1, max_norm / (norm + 1e-6))``). Other models take
``clip_grad_norm_`` itself.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["clip_grad_norm"]


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def clip_grad_norm(model: nn.Module, max_norm: float) -> Tensor:
    """Clip the gradients of ``model``'s parameters to ``max_norm`` in total; returns
    the total norm before clipping (a collective when the model is sharded)."""
    if not getattr(model, "_rayrl_expert_parallel", 0):
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
    if not grads:
        return torch.zeros(())
    squares = torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum()
    dist.all_reduce(squares)
    norm = squares.sqrt()
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(scale.to(g.dtype))
    return norm
