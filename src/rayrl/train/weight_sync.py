"""Training weights to the rollout engine: full tensors by name, in the rollout's dtype,
a bucket at a time.

`rollout_weights` walks the model's parameters in order and yields ``(name, tensor)``
pairs that a rollout engine's ``update_weights`` consumes as they come. A sharded
(FSDP2) parameter is cast to the rollout dtype *before* it is all-gathered, so the
gather moves bf16, not fp32, and no rank ever holds more than one bucket of gathered
tensors (``bucket_bytes``): never the whole fp32 state. Under hybrid sharding the gather runs
within a rank's sharding group (its replicas hold the same shards), so it stays inside a
node. An unsharded parameter is cast
(or, when it already has the dtype, handed over as it is, without a copy).

Names are the model's own (FSDP2 keeps Hugging Face names); tied parameters appear
once, under their first name.

Rollout replicas in other processes (`rollout.mode=async`) take the same stream
packed: `pack_buckets` copies consecutive tensors of one dtype into one flat host
buffer of about ``bucket_bytes`` (one object to move per bucket, whatever the number
of tensors) and `unpack_bucket` gives the ``(name, tensor)`` pairs back as views of it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from rayrl import progress

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "PackedBucket",
    "PublishedWeights",
    "pack_buckets",
    "rollout_weights",
    "unpack_bucket",
]

DEFAULT_BUCKET_BYTES = 512 << 20


def full_tensor(param: Tensor, dtype: torch.dtype) -> Tensor:
    """The whole tensor in ``dtype``: cast the local shard, then gather (a collective)."""
    data = param.detach()
    if hasattr(data, "full_tensor"):  # a DTensor (FSDP2 shard)
        return data.to(dtype).full_tensor()
    return data if data.dtype == dtype else data.to(dtype)


def _dim0_shard(param: Tensor) -> bool:
    """An FSDP2 parameter: a DTensor sharded on dim 0 as ``torch.chunk`` over its mesh's
    last dimension, replicated over any other (HSDP's ``[replicate, shard]``)."""
    from torch.distributed.tensor import Replicate, Shard

    data = param.detach()
    if not hasattr(data, "full_tensor"):
        return False
    *outer, last = data.placements
    return last == Shard(0) and all(p == Replicate() for p in outer)


def _gather_bucket(
    params: list[tuple[str, Tensor]], dtype: torch.dtype
) -> list[tuple[str, Tensor]]:
    """Full tensors of dim-0 shards on one mesh, with ONE all-gather for the bucket.

    Each rank packs its shards, cast to ``dtype`` and padded to the chunk size
    (``ceil(rows / world)`` rows, as FSDP2's ``torch.chunk`` split), into one buffer; after
    the gather, a tensor is its ranks' chunks in order, cut to its row count. A
    collective's latency is paid once per bucket, not once per parameter
    (docs/benchmarks.md).
    """
    import torch.distributed as dist

    mesh = params[0][1].device_mesh
    shard_dim = mesh.ndim - 1  # replicas (HSDP) hold the same shards: gather within one
    world = mesh.size(shard_dim)
    shapes = [p.shape for _, p in params]
    chunk = [-(-shape[0] // world) * (shape[1:].numel()) for shape in shapes]
    local = torch.zeros(sum(chunk), dtype=dtype, device=params[0][1].to_local().device)
    at = 0
    for (_, p), size in zip(params, chunk, strict=True):
        shard = p.detach().to_local().reshape(-1)
        local[at : at + shard.numel()].copy_(shard)
        at += size
    if world == 1:  # FSDP2 on one rank (one GPU): the shard is the tensor
        gathered = local
    else:
        gathered = torch.empty(world * local.numel(), dtype=dtype, device=local.device)
        dist.all_gather_into_tensor(gathered, local, group=mesh.get_group(shard_dim))
    gathered = gathered.view(world, -1)
    out, at = [], 0
    for (name, _), shape, size in zip(params, shapes, chunk, strict=True):
        rows = gathered[:, at : at + size].reshape(-1, *shape[1:])
        out.append((name, rows[: shape[0]].contiguous()))
        at += size
    return out


def rollout_weights(
    model: nn.Module, dtype: torch.dtype, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[tuple[str, Tensor]]:
    """``(name, full tensor in dtype)`` for every parameter, gathered bucket by bucket.

    Every rank of a sharded model must consume the whole iterator (each bucket's
    gather is a collective). FSDP2 parameters of a bucket are gathered together
    (`_gather_bucket`); any other parameter alone, in order.
    """
    return stream_buckets(
        model,
        dtype,
        bucket_bytes,
        bucket=lambda params: _gather_bucket(params, dtype),
        single=lambda name, param: full_tensor(param, dtype),
    )


def stream_buckets(
    model: nn.Module,
    dtype: torch.dtype,
    bucket_bytes: int,
    *,
    bucket: Callable[[list[tuple[str, Tensor]]], list[tuple[str, Tensor]]],
    single: Callable[[str, Tensor], Tensor],
    shardable: Callable[[Tensor], bool] = _dim0_shard,
) -> Iterator[tuple[str, Tensor]]:
    """``(name, tensor)`` for every parameter in order: `shardable` parameters of one mesh
    in buckets of about ``bucket_bytes`` (in ``dtype``), each bucket turned into its
    tensors by one `bucket` call (a collective), any other parameter by `single`."""
    pending: list[tuple[str, Tensor]] = []  # dim-0 shards on one mesh, not yet sent
    size = 0

    def flush() -> list[tuple[str, Tensor]]:
        nonlocal pending, size
        done = bucket(pending) if pending else []
        pending, size = [], 0
        if done:
            progress.tick(weight_buckets=1)  # the watchdog sees the sync move
        return done

    for name, param in model.named_parameters():
        if shardable(param) and (not pending or param.device_mesh is pending[0][1].device_mesh):
            pending.append((name, param))
            size += param.numel() * dtype.itemsize
            if size >= bucket_bytes:
                yield from flush()
            continue
        yield from flush()
        yield name, single(name, param)
        progress.tick(weight_tensors=1)
    yield from flush()


@dataclass
class PackedBucket:
    """Tensors of one dtype in one flat host buffer, in order: what crosses processes."""

    names: list[str]
    shapes: list[tuple[int, ...]]
    flat: Tensor  # 1-D, on the CPU: every tensor's elements, one after another

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


@dataclass
class PublishedWeights:
    """One policy version, published for rollout replicas in other processes: a handle
    per packed bucket (Ray object references, opaque here), their bytes, and how they
    travel: ``object_store`` (each replica fetches the buckets itself) or
    ``collective`` (broadcast over `group`, a `rayrl.cluster.broadcast.BroadcastSpec`,
    under the store key `key`; the object-store copy in `refs` serves replicas that
    miss the broadcast). `fallback` says why a collective publish went by the object
    store instead (empty when it did not)."""

    refs: list[Any]
    nbytes: int
    transport: str = "object_store"
    group: Any = None
    key: str = ""
    fallback: str = ""

    def by_object_store(self) -> PublishedWeights:
        """The same version for a replica to fetch from the object store."""
        return PublishedWeights(self.refs, self.nbytes)


def pack_buckets(
    weights: Iterable[tuple[str, Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[PackedBucket]:
    """``weights`` (e.g. `rollout_weights`) packed into flat host buffers of about
    ``bucket_bytes``; a new bucket starts where the dtype changes or the bucket is full.
    A tensor larger than ``bucket_bytes`` makes a bucket of its own."""
    names: list[str] = []
    tensors: list[Tensor] = []
    size = 0

    def flush() -> PackedBucket:
        nonlocal names, tensors, size
        flat = torch.cat([t.detach().reshape(-1).to("cpu") for t in tensors])
        bucket = PackedBucket(names, [tuple(t.shape) for t in tensors], flat)
        names, tensors, size = [], [], 0
        return bucket

    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if tensors and (tensor.dtype != tensors[0].dtype or size + nbytes > bucket_bytes):
            yield flush()
        names.append(name)
        tensors.append(tensor)
        size += nbytes
    if tensors:
        yield flush()


def unpack_bucket(bucket: PackedBucket) -> Iterator[tuple[str, Tensor]]:
    """``(name, tensor)`` of a `PackedBucket`, each a view of its flat buffer."""
    at = 0
    for name, shape in zip(bucket.names, bucket.shapes, strict=True):
        count = 1
        for dim in shape:
            count *= dim
        yield name, bucket.flat[at : at + count].view(shape)
        at += count
