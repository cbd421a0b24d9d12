"""Filling an empty (meta-built, possibly sharded) model from one read of its weights.

The training engine builds its model on the meta device (`rayrl.train.loading`),
shards it, allocates each rank's shards on its device (`materialize`), then fills them:

* `load_checkpoint`: rank 0 alone reads the checkpoint, a tensor at a time in its saved
  dtype (`rayrl.models.safetensors_read`), and hands each rank its shard of it: broadcast
  to the first rank of every sharding group (under HSDP one per node), scattered within
  each group; every rank casts its shard to the training dtype as it stores it. Host
  memory never holds a whole copy of the model on any rank (on a GPU, only the tensor
  being read), storage is read once per start, not once per rank. A value head the checkpoint lacks (a critic started from a
  policy) is drawn on rank 0 from the engine's seed, so every world size gets the same.
* `copy_weights`: the same from another engine's model in this process (the reference
  policy from the actor's load): shard to shard where both are laid out alike, else a
  gather per tensor; no read at all.
* `load_own_shards`: one rank alone, no collective: it reads only the rows of each
  tensor that its shard holds. A rank that replaces a lost one of a group whose other
  ranks kept their weights fills its frozen weights this way (`rayrl.train.rebuild`).

`LoadReport` carries what a start cost: bytes read from storage (all ranks), the peak
host memory of a node (the sum of its ranks' peak resident sizes, ``VmHWM``) and the
time, as the metrics ``load/bytes_read``, ``load/host_peak_gb_per_node``,
``load/seconds``.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from rayrl.models.safetensors_read import CheckpointIndex, CheckpointReader, TensorEntry

__all__ = [
    "LoadReport",
    "checkpoint_tensors",
    "copy_weights",
    "host_peak_bytes",
    "load_checkpoint",
    "load_own_shards",
    "materialize",
    "node_peak_gb",
    "weight_file_bytes",
    "weight_plan",
]


@dataclass
class LoadReport:
    """How an engine got its weights. ``source``: "checkpoint" (read once and shared),
    "engine" (copied from another engine's load), "from_pretrained" (every rank read
    the whole model itself)."""

    source: str
    bytes_read: int
    seconds: float
    host_peak_gb_per_node: float

    def metrics(self) -> dict[str, float]:
        return {
            "load/bytes_read": float(self.bytes_read),
            "load/host_peak_gb_per_node": self.host_peak_gb_per_node,
            "load/seconds": self.seconds,
        }


def host_peak_bytes() -> int:
    """This process's peak resident memory so far (``VmHWM``; else ``ru_maxrss``)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def node_peak_gb(sharded: bool) -> float:
    """The largest, over nodes, of the sum of the peak resident memory of a node's ranks
    (a collective when ``sharded``)."""
    mine = (socket.gethostname(), host_peak_bytes())
    if not sharded:
        return mine[1] / 2**30
    every: list[Any] = [None] * dist.get_world_size()  # (host, peak bytes) per rank
    dist.all_gather_object(every, mine)
    nodes: dict[str, int] = {}
    for host, peak in every:
        nodes[host] = nodes.get(host, 0) + peak
    return max(nodes.values()) / 2**30


def checkpoint_tensors(model: nn.Module) -> list[tuple[str, Tensor]]:
    """What a checkpoint holds: parameters (a tied one once) and persistent buffers."""
    skip = set()
    for prefix, module in model.named_modules():
        for name in getattr(module, "_non_persistent_buffers_set", ()):
            skip.add(f"{prefix}.{name}" if prefix else name)
    buffers = [(n, b) for n, b in model.named_buffers() if n not in skip]
    return [*model.named_parameters(), *buffers]


def materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate the meta parameters (a sharded model's local shards) on ``device``,
    uninitialised; the buffers keep their values."""
    kept = {name: b.detach().clone() for name, b in model.named_buffers()}
    shared = _shared_parameters(model)
    model.to_empty(device=device)
    for owners in shared:  # a tied parameter became one per owner: tie them again
        first_module, first_name = owners[0]
        for module, name in owners[1:]:
            module._parameters[name] = first_module._parameters[first_name]
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(kept[name])


def _shared_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """The (module, name) owners of each parameter that several modules hold (tied)."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((module, name))
    return [o for o in owners.values() if len(o) > 1]


def weight_plan(
    model: nn.Module, index: CheckpointIndex, value_head: bool
) -> dict[str, TensorEntry | None] | str:
    """Checkpoint entry per model tensor (None: a value head to draw), or why the
    checkpoint's names or shapes do not map onto the model's."""
    base = getattr(model, "base_model_prefix", "model")
    plan: dict[str, TensorEntry | None] = {}
    for name, tensor in checkpoint_tensors(model):
        entry = index.get(name)
        if entry is None:
            if value_head and not name.startswith(f"{base}."):
                plan[name] = None
                continue
            return f"the checkpoint has no tensor named {name}"
        if entry.shape != tuple(tensor.shape):
            return (
                f"{name} is {entry.shape} in the checkpoint and {tuple(tensor.shape)} in the model"
            )
        plan[name] = entry
    return plan


def _place(target: Tensor, full: Tensor) -> None:
    """Copy the full tensor into ``target`` (its local shard when sharded), cast as it
    is copied: no cast copy of the full tensor."""
    if hasattr(target, "to_local"):
        from torch.distributed.tensor import distribute_tensor

        local = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(local.to_local())
    else:
        target.copy_(full)


def _drawn_head(shape: tuple[int, ...], generator: torch.Generator, std: float) -> Tensor:
    """A new value head's tensor: weights ~ N(0, std) (transformers' Linear init), bias 0."""
    if len(shape) < 2:
        return torch.zeros(shape)
    return torch.randn(shape, generator=generator) * std


def load_checkpoint(
    model: nn.Module,
    plan: dict[str, TensorEntry | None],
    index: CheckpointIndex,
    device: torch.device,
    sharded: bool,
    seed: int,
) -> int:
    """Fill ``model`` from the checkpoint of ``plan`` (`weight_plan`); rank 0 reads and
    broadcasts when ``sharded`` (every rank must call it). Returns the bytes this rank
    read."""
    source = not sharded or dist.get_rank() == 0
    generator = torch.Generator().manual_seed(seed)
    std = float(getattr(model.config, "initializer_range", 0.02))
    with CheckpointReader(index) as reader, torch.no_grad():
        for name, target in checkpoint_tensors(model):
            entry = plan[name]
            shape = tuple(target.shape)
            dtype = entry.dtype if entry else torch.float32
            full = None
            if source:
                full = reader.read(name) if entry else _drawn_head(shape, generator, std)
                full = full.to(device)
            if not sharded:
                _place(target, full)
            elif _dim0_shard(target):
                _scatter(target, full, shape, dtype, device)
            else:
                if full is None:
                    full = torch.empty(shape, dtype=dtype, device=device)
                dist.broadcast(full, src=0)
                _place(target, full)
            del full
        return reader.bytes_read


def load_own_shards(
    model: nn.Module,
    plan: dict[str, TensorEntry | None],
    index: CheckpointIndex,
    seed: int,
) -> int:
    """Fill this rank's shards of ``model`` (`weight_plan`'s ``plan``) from the checkpoint,
    with no collective: a dim-0 shard reads only its rows, any other tensor is read whole
    and cut here; a value head to draw is drawn whole from ``seed``, as `load_checkpoint`
    draws it. Returns the bytes read."""
    generator = torch.Generator().manual_seed(seed)
    std = float(getattr(model.config, "initializer_range", 0.02))
    with CheckpointReader(index) as reader, torch.no_grad():
        for name, target in checkpoint_tensors(model):
            entry = plan[name]
            if entry is None:
                _place(target, _drawn_head(tuple(target.shape), generator, std))
                continue
            rows = _own_rows(target)
            if rows is None:
                _place(target, reader.read(name))
                continue
            local = target.to_local()
            local.copy_(reader.read_rows(name, rows, rows + local.shape[0]))
        return reader.bytes_read


def _own_rows(target: Tensor) -> int | None:
    """The first row of this rank's part of a DTensor split on dim 0 only (replicated
    elsewhere), or None for any other tensor."""
    if not hasattr(target, "to_local") or target.dim() == 0:
        return None
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not all(p == Shard(0) or p == Replicate() for p in target.placements):
        return None
    shape, offset = compute_local_shape_and_global_offset(
        target.shape, target.device_mesh, target.placements
    )
    if tuple(shape) != tuple(target.to_local().shape):
        return None
    return int(offset[0]) if shape[0] else 0


def _dim0_shard(target: Tensor) -> bool:
    """An FSDP2 shard: dim 0 split over the mesh's last dimension, replicated over any
    other (HSDP), on a mesh whose first rank is global rank 0 (the reader)."""
    if not hasattr(target, "to_local"):
        return False
    from torch.distributed.tensor import Replicate, Shard

    *outer, last = target.placements
    first = int(target.device_mesh.mesh.flatten()[0])
    return last == Shard(0) and all(p == Replicate() for p in outer) and first == 0


def _scatter(
    target: Tensor,
    full: Tensor | None,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Give each rank its dim-0 shard of the tensor rank 0 holds: broadcast to the first
    rank of each sharding group (one per replica; under HSDP, one per node), then
    scatter within each group. A rank receives its shard, not the whole tensor."""
    mesh = target.device_mesh
    last = mesh.ndim - 1
    leader = mesh.get_local_rank(last) == 0
    if mesh.ndim > 1 and leader:
        if full is None:
            full = torch.empty(shape, dtype=dtype, device=device)
        for dim in range(last):
            dist.broadcast(full, group=mesh.get_group(dim), group_src=0)
    ranks = mesh.size(last)
    rows = -(-shape[0] // ranks)  # torch.chunk's split, as FSDP2's
    piece = torch.empty((rows, *shape[1:]), dtype=dtype, device=device)
    parts = None
    if leader:
        if full is None:  # rank 0 reads; each group's first rank got it by broadcast
            raise RuntimeError("a sharding group's first rank has no tensor to scatter")
        parts = [_padded(c, rows) for c in full.split(rows)]
        parts += [torch.zeros_like(piece) for _ in range(ranks - len(parts))]
    dist.scatter(piece, parts, group=mesh.get_group(last), group_src=0)
    local = target.to_local()
    local.copy_(piece[: local.shape[0]])


def _padded(chunk: Tensor, rows: int) -> Tensor:
    if chunk.shape[0] == rows:
        return chunk.contiguous()
    out = chunk.new_zeros((rows, *chunk.shape[1:]))
    out[: chunk.shape[0]] = chunk
    return out


def _same_layout(a: Tensor, b: Tensor) -> bool:
    """Both DTensors sharded alike over the same ranks (or both plain tensors)."""
    if hasattr(a, "to_local") != hasattr(b, "to_local"):
        return False
    if not hasattr(a, "to_local"):
        return True
    ma, mb = a.device_mesh, b.device_mesh
    return (
        tuple(ma.mesh.shape) == tuple(mb.mesh.shape)
        and torch.equal(ma.mesh, mb.mesh)
        and tuple(a.placements) == tuple(b.placements)
    )


def copy_weights(model: nn.Module, source: nn.Module) -> None:
    """Fill ``model`` from ``source``, a model of the same names and shapes (every rank
    must call it when either is sharded)."""
    theirs = dict(checkpoint_tensors(source))
    with torch.no_grad():
        for name, target in checkpoint_tensors(model):
            if name not in theirs:
                raise KeyError(
                    f"cannot take {name} from the other engine's model ({type(source).__name__}): "
                    "it has no tensor of that name; build this engine from its model directory"
                )
            other = theirs[name]
            if _same_layout(target, other):
                local = other.to_local() if hasattr(other, "to_local") else other
                (target.to_local() if hasattr(target, "to_local") else target).copy_(local)
            else:
                _place(target, other.full_tensor() if hasattr(other, "full_tensor") else other)


def weight_file_bytes(path: str) -> int:
    """Bytes of a model directory's weight files (what loading it whole reads)."""
    from pathlib import Path

    suffixes = (".safetensors", ".bin", ".pt", ".pth")
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.suffix in suffixes)
