"""Ulysses sequence parallelism: one packed row's tokens split over ``sp`` ranks.

The ranks of a sequence-parallel (SP) group hold the same micro-batch. Its packed row
(`rayrl.train.packing`: every sequence back to back, no padding, restarting
positions) is padded to a multiple of ``sp`` tokens and each rank runs the model on its
contiguous ``1/sp`` of the tokens (`split_packed`): embeddings, norms, MLPs and the
rotary embedding are per token and need nothing else. Attention needs every token of a
sequence, so around it (`attend`) an all-to-all trades the sequence split for a head
split: each rank gets ``heads / sp`` heads of the whole row, attends per sequence with
the row's full boundaries (varlen, `rayrl.train.attention`), and a second all-to-all
gives the heads back for its own tokens. Key/value heads fewer than ``sp`` are repeated
first (grouped-query attention keeps its query-to-KV mapping).

Outputs: each rank computes log-probs (or values) only at its own response positions,
then `gather_kept` all-gathers them in token order, so every rank of the group holds the
micro-batch's full ``[b, R]`` outputs and computes the same loss. Its backward hands
each rank the gradient of its own positions, without communication: the ranks'
parameter gradients then add up to the gradient of one copy of the loss, and the
engine's sum over all ranks (loss x world size under FSDP's average) counts each
data-parallel group once.

The collectives are autograd functions, so the backward runs the reverse exchanges, and
activation checkpointing recomputes them: the SP group is attached to the attention
modules themselves (`attach`), not to a context that the backward would have left.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = [
    "SPGroup",
    "SPSlice",
    "attach",
    "attend",
    "check_same_rows",
    "gather_kept",
    "group_of",
    "split_packed",
]

_ATTR = "_rayrl_ulysses"


@dataclass(frozen=True)
class SPGroup:
    """A sequence-parallel process group: its size, this rank's place in it."""

    group: Any
    size: int
    rank: int


def attach(model: nn.Module, sp: SPGroup, attention_modules: list[nn.Module]) -> None:
    """Mark ``attention_modules`` of ``model`` as sequence-parallel over ``sp``."""
    if not attention_modules:
        raise ValueError(
            f"cannot find the attention modules of {type(model).__name__} (a `self_attn` in "
            "each decoder layer); Ulysses sequence parallelism needs them"
        )
    for module in attention_modules:
        setattr(module, _ATTR, sp)


def group_of(module: nn.Module) -> SPGroup | None:
    """The SP group `attach` gave this attention module, if any."""
    return getattr(module, _ATTR, None)


# ------------------------------------------------------------------ collectives
class _AllToAll(torch.autograd.Function):
    """Exchange dim-0 slices: slice ``j`` goes to rank ``j``; the result's slice ``i``
    came from rank ``i``. Its own adjoint, so the backward is the same exchange."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def heads_to_sequence(x: Tensor, sp: SPGroup) -> Tensor:
    """``[1, H, T/sp, D]`` (all heads, this rank's tokens) -> ``[1, H/sp, T, D]`` (this
    rank's heads, every token, in rank order)."""
    _, heads, local, dim = x.shape
    parts = x[0].reshape(sp.size, heads // sp.size, local, dim)
    got = _AllToAll.apply(parts, sp.group)  # [source rank (token chunk), H/sp, T/sp, D]
    return got.transpose(0, 1).reshape(1, heads // sp.size, sp.size * local, dim)


def sequence_to_heads(x: Tensor, sp: SPGroup) -> Tensor:
    """``[1, T, H/sp, D]`` (every token, this rank's heads) -> ``[1, T/sp, H, D]`` (this
    rank's tokens, all heads)."""
    _, tokens, heads, dim = x.shape
    local = tokens // sp.size
    parts = x[0].reshape(sp.size, local, heads, dim)
    got = _AllToAll.apply(parts, sp.group)  # [source rank (head chunk), T/sp, H/sp, D]
    return got.transpose(0, 1).reshape(1, local, sp.size * heads, dim)


def attend(sp: SPGroup, query: Tensor, key: Tensor, value: Tensor, attention: Any) -> Tensor:
    """Attention over the whole row from this rank's tokens: ``query`` ``[1, Hq, T/sp,
    D]``, ``key``/``value`` ``[1, Hkv, T/sp, D]``; ``attention(q, k, v)`` attends the
    full row (``[1, h, T, D]`` inputs, ``[1, T, h, D]`` out). Returns ``[1, T/sp, Hq, D]``."""
    kv_heads = key.shape[1]
    if kv_heads % sp.size:  # fewer KV heads than ranks: one copy of each per rank
        repeat = sp.size // kv_heads
        key, value = (t.repeat_interleave(repeat, dim=1) for t in (key, value))
    q, k, v = (heads_to_sequence(t, sp) for t in (query, key, value))
    return sequence_to_heads(attention(q, k, v), sp)


class _GatherKept(torch.autograd.Function):
    """All-gather dim-0 pieces of different lengths (``counts``, known on every rank) in
    rank order; the backward keeps this rank's piece of the gradient."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, counts: list[int], sp: SPGroup) -> Tensor:
        ctx.start = sum(counts[: sp.rank])
        ctx.count = counts[sp.rank]
        width = max(counts)
        padded = local.new_zeros((width, *local.shape[1:]))
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in range(sp.size)]
        dist.all_gather(parts, padded, group=sp.group)
        return torch.cat([p[:n] for p, n in zip(parts, counts, strict=True)])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return grad[ctx.start : ctx.start + ctx.count], None, None


def gather_kept(local: Tensor, counts: list[int], sp: SPGroup) -> Tensor:
    """Every rank's ``local`` values (``counts[r]`` rows from rank ``r``), concatenated in
    rank order (see the module docstring for the gradient)."""
    return _GatherKept.apply(local, counts, sp)


# ---------------------------------------------------------------- input split
@dataclass
class SPSlice:
    """This rank's share of a packed row, and where its kept positions fall.

    Attributes:
        input_ids: ``[1, T/sp]`` this rank's tokens of the padded row.
        position_ids: ``[1, T/sp]`` their positions.
        lengths: the sequence lengths of the whole padded row (the padding a sequence
            of its own), for the attention's boundaries.
        keep: this rank's kept positions, relative to its first token.
        keep_mask: which of the row's kept positions are this rank's (1-D, in order).
        counts: kept positions per rank (every rank's, for `gather_kept`).
        start: this rank's first token in the padded row.
    """

    input_ids: Tensor
    position_ids: Tensor
    lengths: list[int]
    keep: Tensor
    keep_mask: Tensor
    counts: list[int]
    start: int


def split_packed(
    input_ids: Tensor,
    position_ids: Tensor,
    lengths: list[int],
    keep: Tensor,
    sp: SPGroup,
) -> SPSlice:
    """Pad a packed ``[1, T]`` row to a multiple of ``sp.size`` tokens and cut out this
    rank's contiguous part. ``keep`` (1-D, ascending) are the row's positions whose
    outputs are wanted; they are split between the ranks that hold them."""
    total = input_ids.shape[1]
    pad = -total % sp.size
    if pad:
        input_ids = torch.cat([input_ids, input_ids.new_zeros((1, pad))], dim=1)
        filler = torch.arange(pad, dtype=position_ids.dtype, device=position_ids.device)
        position_ids = torch.cat([position_ids, filler.unsqueeze(0)], dim=1)
        lengths = [*lengths, pad]
    local = (total + pad) // sp.size
    start = sp.rank * local
    owner = torch.div(keep, local, rounding_mode="floor")
    counts = torch.bincount(owner, minlength=sp.size).tolist()
    mine = owner == sp.rank
    return SPSlice(
        input_ids=input_ids[:, start : start + local],
        position_ids=position_ids[:, start : start + local],
        lengths=list(lengths),
        keep=keep[mine] - start,
        keep_mask=mine,
        counts=[int(c) for c in counts],
        start=start,
    )


def check_same_rows(input_ids: Tensor, sp: SPGroup, device: Any, call: str) -> None:
    """ValueError unless every rank of the SP group got the same rows (a sum of the token
    ids weighted by column, and the shape, compared over the group)."""
    weights = torch.arange(1, input_ids.shape[1] + 1, dtype=torch.float64)
    digest = [
        float(input_ids.shape[0]),
        float(input_ids.shape[1]),
        float((input_ids.to(torch.float64) * weights).sum()),
    ]
    values = torch.tensor(digest + [-d for d in digest], dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=sp.group)
    high, low = values[:3], -values[3:]
    if not torch.equal(high, low):
        raise ValueError(
            f"{call}: the {sp.size} ranks of a Ulysses sequence-parallel group got different "
            f"rows (this rank: {int(digest[0])} rows); they split the tokens of the same rows, "
            "so the caller must give every rank of a group the same batch (dispatch by "
            "data-parallel rank: the engine's dp_rank and dp_size)"
        )
