"""Training weights straight into tensor-parallel rollout shards: each rank receives its part.

`tp_rollout_weights` is `rayrl.train.weight_sync.rollout_weights` for a native engine
split over TP ranks: it yields ``(HF name, this rank's part)`` pairs, in the rollout
dtype, for ``NativeRolloutEngine.update_weights(..., sharded=True)``. What moves where,
for an FSDP2 model whose parameters are dim-0 shards over a group of ``W`` ranks (rank
``s`` holds rows ``[s * c, (s + 1) * c)``, ``c = ceil(rows / W)``, as ``torch.chunk``
splits them) and rollout replicas of ``tp`` consecutive ranks (world rank ``g`` is TP
rank ``g % tp``, `rayrl.rollout.native.tp`):

- parameters go in buckets of about ``bucket_bytes`` (of whole tensors), with ONE
  all-to-all per bucket: rank ``s`` sends rank ``d``, for each parameter, the piece of
  its own shard that ``d``'s TP part covers, cast to the rollout dtype first: the rows
  of the part it holds (q / k / v / gate / up rows, vocabulary rows of the embedding and
  LM head), or the part's columns of all its rows (o / down projections; a mixture of
  experts' 3-D ``down_proj``: its experts' columns), or all its rows (norms, the o bias
  and the router, which every rank holds whole, and a fused tensor: Phi-3's, a mixture
  of experts' ``gate_up_proj``, whose rank's part is not one range);
- rank ``d`` concatenates the pieces in source order: that is its part (rows of the part
  in order; all rows of the part's columns), never the whole tensor except for the small
  ones every rank holds whole. Per bucket a rank receives about ``1 / tp`` of it, where
  `rollout_weights` all-gathers the whole bucket to every rank;
- a mixture of experts' weights under expert parallelism (on the ``[edp, ep]`` mesh) go
  in the same buckets, made whole by one all-gather per bucket
  (`rayrl.train.expert_sync`) and narrowed on each rank;
- a parameter that is not a dim-0 shard on a 1-D mesh (one process, or HSDP's 2-D
  mesh) is made whole (``full_tensor()``, a collective) and narrowed on each rank, as
  `rollout_weights` followed by ``update_weights`` does.

Every rank of the group must consume the whole iterator, in step (the all-to-alls and
gathers are collectives). LoRA adapters are not merged here: stream
``TrainEngine.rollout_weights`` (whole tensors) for a LoRA model instead.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

from rayrl.rollout.native.shards import TPShard
from rayrl.rollout.native.spec import ModelSpec
from rayrl.train.expert_sync import expert_shard, gather_experts
from rayrl.train.weight_sync import DEFAULT_BUCKET_BYTES, full_tensor, stream_buckets

__all__ = ["tp_rollout_weights"]


def tp_rollout_weights(
    model: nn.Module,
    dtype: torch.dtype,
    spec: ModelSpec,
    tp_size: int,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> Iterator[tuple[str, Tensor]]:
    """``(name, this rank's TP part in dtype)`` for every parameter of ``model``.

    Args:
        model: the training model (FSDP2-wrapped or not), HF parameter names.
        spec: the rollout model's `ModelSpec` (the whole model's).
        tp_size: the rollout's ``tensor_model_parallel_size``.
    """
    shards = [TPShard(spec, tp_size, t) for t in range(tp_size)]
    mine = shards[(dist.get_rank() if dist.is_initialized() else 0) % tp_size]
    return stream_buckets(
        model,
        dtype,
        bucket_bytes,
        bucket=lambda params: _bucket(params, dtype, shards, mine),
        single=lambda name, param: mine.take(name, full_tensor(param, dtype)).contiguous(),
        shardable=lambda param: _dim0_shard(param) or expert_shard(param),
    )


def _bucket(
    params: list[tuple[str, Tensor]], dtype: torch.dtype, shards: list[TPShard], mine: TPShard
) -> Iterable[tuple[str, Tensor]]:
    """This rank's parts of one bucket's parameters on one mesh: FSDP2 shards by one
    all-to-all (`_exchange`), expert-parallel weights made whole by one all-gather
    (`rayrl.train.expert_sync`) and narrowed."""
    if expert_shard(params[0][1]):
        return ((n, mine.take(n, t).contiguous()) for n, t in gather_experts(params, dtype))
    return _exchange(params, dtype, shards)


def _dim0_shard(param: Tensor) -> bool:
    """An FSDP2 parameter: a DTensor on a 1-D mesh, sharded on dim 0."""
    from torch.distributed.tensor import Shard

    data = param.detach()
    return hasattr(data, "full_tensor") and tuple(data.placements) == (Shard(0),)


def _rows_held(rows: int, world: int, rank: int) -> tuple[int, int]:
    """``[r0, r1)``: the rows ``torch.chunk`` gives ``rank`` of ``world`` (maybe none)."""
    chunk = -(-rows // world)
    r0 = min(rows, rank * chunk)
    return r0, min(rows, r0 + chunk)


def _piece(name: str, shape: torch.Size, held: tuple[int, int], shard: TPShard):
    """What of a source's rows ``held`` destination ``shard`` needs: (rows ``[a, b)`` of
    the source's local tensor, the part of another dim to narrow them to (`Part`; None:
    all of it), and the piece's shape."""
    r0, r1 = held
    part = shard.part(name) if shard.size > 1 else None
    if part is None or part.dim > 0:
        rows, cut = (0, r1 - r0), part
    else:
        a, b = max(r0, part.start), min(r1, part.stop)
        rows, cut = (a - r0, max(a, b) - r0), None
    out = [rows[1] - rows[0], *shape[1:]]
    if cut is not None:
        out[cut.dim] = cut.stop - cut.start
    return rows, cut, out


def _exchange(
    params: list[tuple[str, Tensor]], dtype: torch.dtype, shards: list[TPShard]
) -> list[tuple[str, Tensor]]:
    """One bucket of dim-0 shards on one mesh: ONE all-to-all, this rank's parts out."""
    group = params[0][1].device_mesh.get_group()
    members = dist.get_process_group_ranks(group)  # world ranks, in group order
    world, me = len(members), dist.get_rank(group)
    targets = [shards[g % len(shards)] for g in members]
    send: list[list[Tensor]] = [[] for _ in range(world)]  # by destination, then parameter
    recv_shapes: list[list[list[int]]] = [[] for _ in range(world)]
    for name, param in params:
        local = param.detach().to_local().to(dtype)
        held = _rows_held(param.shape[0], world, me)
        if local.shape[0] != held[1] - held[0]:
            raise RuntimeError(
                f"tp_rollout_weights: {name!r} has {local.shape[0]} local rows on rank {me}, "
                f"not the {held[1] - held[0]} of a torch.chunk split; is it an FSDP2 shard?"
            )
        for d, target in enumerate(targets):
            rows, cut, _ = _piece(name, param.shape, held, target)
            piece = local[rows[0] : rows[1]]
            if cut is not None:
                piece = piece.narrow(cut.dim, cut.start, cut.stop - cut.start)
            send[d].append(piece.reshape(-1))
        for s in range(world):
            recv_shapes[s].append(
                _piece(name, param.shape, _rows_held(param.shape[0], world, s), targets[me])[2]
            )
    send_sizes = [sum(piece.numel() for piece in pieces) for pieces in send]
    recv_sizes = [sum(math.prod(shape) for shape in shapes) for shapes in recv_shapes]
    flat = torch.cat([piece for pieces in send for piece in pieces])
    received = torch.empty(sum(recv_sizes), dtype=dtype, device=flat.device)
    dist.all_to_all_single(received, flat, recv_sizes, send_sizes, group=group)
    pieces = [
        block.split([math.prod(shape) for shape in shapes])
        for block, shapes in zip(received.split(recv_sizes), recv_shapes, strict=True)
    ]
    return [
        (name, torch.cat([pieces[s][i].view(recv_shapes[s][i]) for s in range(world)]))
        for i, (name, _) in enumerate(params)
    ]
