"""Expert-parallel weights made whole for the rollout engine: a bucket of experts, one
all-gather.

Under expert parallelism (`rayrl.train.expert_parallel`) each 3-D expert weight
(``gate_up_proj`` ``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``) is a DTensor on the
``[edp, ep]`` mesh (`rayrl.train.mesh`) with placements ``(_StridedShard(0), Shard(0))``:
EP rank ``r`` holds the block of experts ``[r B, (r + 1) B)`` (``B = E / ep``), and FSDP
splits that block over the ``edp`` ranks as ``torch.chunk`` does, so the rank at mesh
coordinate ``(d, r)`` holds rows ``[r B + d c, r B + (d + 1) c)`` (``c = ceil(B / edp)``),
maybe fewer at the block's end. Every element lives on exactly one rank of the world.

``full_tensor()`` of such a weight runs two all-gathers per tensor, one per mesh
dimension, and `rayrl.train.weight_sync` would make each expert weight whole alone.
`gather_experts` makes a whole bucket of them whole with ONE all-gather over the world:
each rank packs its shards (cast to the rollout dtype, each padded to ``c`` rows) into
one buffer; after the gather, a tensor is, for each EP block in order, its ``edp`` ranks'
chunks in order, cut to ``B`` rows. A rank holds its own shards plus the gathered
bucket, never more (`weight_sync.stream_buckets` sizes the buckets).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["EXPERT_MESH_DIMS", "expert_shard", "gather_experts"]

# The expert-parallel mesh's dimension names (`rayrl.train.mesh.TrainMesh.experts`).
EXPERT_MESH_DIMS = ("edp", "ep")


def expert_shard(param: Tensor) -> bool:
    """An expert-parallel weight: a DTensor on the ``[edp, ep]`` mesh, both of whose
    placements shard dim 0 (module docstring)."""
    data = param.detach()
    if not hasattr(data, "device_mesh"):
        return False
    placements = tuple(data.placements)
    return (
        tuple(data.device_mesh.mesh_dim_names or ()) == EXPERT_MESH_DIMS
        and len(placements) == 2
        and all(getattr(p, "dim", None) == 0 for p in placements)
    )


def _world_order(mesh: DeviceMesh) -> list[int]:
    """The world ranks in the order their chunks make a whole tensor: EP block by EP
    block, each block's ``edp`` ranks in order."""
    edp, ep = mesh.size(0), mesh.size(1)
    ranks = mesh.mesh.reshape(edp, ep)
    world = dist.get_world_size()
    if ranks.numel() != world:
        raise RuntimeError(
            f"gather_experts: the experts' [edp, ep] mesh holds {ranks.numel()} ranks, the "
            f"process group {world}; expert parallelism shards over the whole group "
            "(rayrl.train.mesh.TrainMesh), so this weight was sharded elsewhere"
        )
    order: list[int] = ranks.t().reshape(-1).tolist()
    return order


def gather_experts(
    params: list[tuple[str, Tensor]], dtype: torch.dtype
) -> Iterator[tuple[str, Tensor]]:
    """Full tensors, in ``dtype``, of expert-parallel weights on one ``[edp, ep]`` mesh,
    with ONE all-gather over the world for the whole list (module docstring), run by the
    call; the tensors are cut from it as they are consumed. Every rank of the world must
    call it with the same names in the same order."""
    mesh = params[0][1].device_mesh
    edp, ep = mesh.size(0), mesh.size(1)
    shapes = [p.shape for _, p in params]
    rows = [-(-(shape[0] // ep) // edp) for shape in shapes]  # c: one chunk's rows
    sizes = [c * shape[1:].numel() for c, shape in zip(rows, shapes, strict=True)]
    device = params[0][1].to_local().device
    local = torch.zeros(sum(sizes), dtype=dtype, device=device)
    at = 0
    for (_, p), size in zip(params, sizes, strict=True):
        shard = p.detach().to_local().reshape(-1)
        local[at : at + shard.numel()].copy_(shard)  # cast as it is copied
        at += size
    world = dist.get_world_size()
    gathered = torch.empty(world * local.numel(), dtype=dtype, device=device)
    dist.all_gather_into_tensor(gathered, local)
    order = torch.tensor(_world_order(mesh), device=device)
    return _unpacked(gathered.view(world, -1), params, sizes, order, ep)


def _unpacked(
    gathered: Tensor,
    params: list[tuple[str, Tensor]],
    sizes: list[int],
    order: Tensor,
    ep: int,
) -> Iterator[tuple[str, Tensor]]:
    """Each expert weight of a gathered bucket, made when it is asked for: the bucket and
    one tensor at a time are held."""
    at = 0
    for (name, param), size in zip(params, sizes, strict=True):
        shape = param.shape
        chunks = gathered[:, at : at + size].index_select(0, order)  # one copy: this tensor
        blocks = chunks.view(ep, -1, *shape[1:])[:, : shape[0] // ep]
        yield name, blocks.reshape(shape)  # a view unless the chunks were padded
        at += size
