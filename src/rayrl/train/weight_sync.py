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

A mixture-of-experts model under expert parallelism holds its experts on another mesh
(``[edp, ep]``); they go in the same buckets as the other weights, each bucket's experts
made whole by one all-gather of their own (`rayrl.train.expert_sync`), so a rank holds
at most a bucket of gathered experts beyond its own shards, never all of a layer's
experts one tensor after another with two collectives each. Without expert parallelism
the experts are FSDP2 shards like any other weight.

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
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from rayrl import progress
from rayrl.train.expert_sync import expert_shard, gather_experts

if TYPE_CHECKING:
    from rayrl.cluster.broadcast import BroadcastSpec

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
) -> Iterator[tuple[str, Tensor]]:
    """Full tensors of dim-0 shards on one mesh, with ONE all-gather for the bucket (run
    by the call; the tensors are cut from it as they are consumed).

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
    return _unpacked(gathered.view(world, -1), [n for n, _ in params], shapes, chunk)


def _unpacked(
    gathered: Tensor, names: list[str], shapes: list[torch.Size], chunk: list[int]
) -> Iterator[tuple[str, Tensor]]:
    """Each tensor of a gathered bucket (``[world, packed]``), made when it is asked
    for: the bucket and one tensor at a time are held, not the bucket twice."""
    at = 0
    for name, shape, size in zip(names, shapes, chunk, strict=True):
        rows = gathered[:, at : at + size].reshape(-1, *shape[1:])
        yield name, rows[: shape[0]].contiguous()
        at += size


def rollout_weights(
    model: nn.Module, dtype: torch.dtype, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[tuple[str, Tensor]]:
    """``(name, full tensor in dtype)`` for every parameter, gathered bucket by bucket.

    Every rank of a sharded model must consume the whole iterator (each bucket's
    gather is a collective). FSDP2 parameters of a bucket are gathered together
    (`_gather_bucket`), expert-parallel weights of a bucket too
    (`rayrl.train.expert_sync.gather_experts`); any other parameter alone, in order.
    """
    return stream_buckets(
        model,
        dtype,
        bucket_bytes,
        bucket=lambda params: gather_any(params, dtype),
        single=lambda name, param: full_tensor(param, dtype),
        shardable=bucketable,
    )


def bucketable(param: Tensor) -> bool:
    """A parameter a bucket gathers: an FSDP2 dim-0 shard or an expert-parallel weight."""
    return _dim0_shard(param) or expert_shard(param)


def gather_any(
    params: list[tuple[str, Tensor]], dtype: torch.dtype
) -> Iterator[tuple[str, Tensor]]:
    """Full tensors of `bucketable` parameters on one mesh: one collective."""
    if expert_shard(params[0][1]):
        return gather_experts(params, dtype)
    return _gather_bucket(params, dtype)


Bucket = Callable[[list[tuple[str, Tensor]]], Iterable[tuple[str, Tensor]]]


def _by_mesh(params: list[tuple[str, Tensor]], bucket: Bucket) -> Iterator[tuple[str, Tensor]]:
    """`bucket` called once per device mesh of ``params`` (its collective run at once,
    meshes in order of first appearance: the same on every rank; equal meshes are one),
    the tensors then taken in the order of ``params``."""
    groups: dict[Any, list[tuple[str, Tensor]]] = {}  # equal meshes (FSDP2 makes one per
    for name, param in params:  # experts module, over the same ranks) share a call
        groups.setdefault(param.device_mesh, []).append((name, param))
    streams = {mesh: iter(bucket(part)) for mesh, part in groups.items()}
    for _, param in params:
        yield next(streams[param.device_mesh])


def stream_buckets(
    model: nn.Module,
    dtype: torch.dtype,
    bucket_bytes: int,
    *,
    bucket: Bucket,
    single: Callable[[str, Tensor], Tensor],
    shardable: Callable[[Tensor], bool] = _dim0_shard,
) -> Iterator[tuple[str, Tensor]]:
    """``(name, tensor)`` for every parameter in order: `shardable` parameters in buckets
    of at most ``bucket_bytes`` (in ``dtype``; a larger tensor is a bucket of its own),
    each bucket turned into its tensors by one `bucket` call (a collective) per device
    mesh it holds (an expert-parallel model's experts and its other weights share a
    bucket: two calls), any other parameter by `single`."""
    pending: list[tuple[str, Tensor]] = []  # shards not yet sent, of one or more meshes
    size = 0

    def flush() -> Iterator[tuple[str, Tensor]]:
        nonlocal pending, size
        if not pending:
            return iter(())
        done = _by_mesh(pending, bucket)
        pending, size = [], 0
        progress.tick(weight_buckets=1)  # the watchdog sees the sync move
        return done

    for name, param in model.named_parameters():
        if shardable(param):
            nbytes = param.numel() * dtype.itemsize
            if pending and size + nbytes > bucket_bytes:
                yield from flush()
            pending.append((name, param))
            size += nbytes
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
        size: int = self.flat.numel() * self.flat.element_size()
        return size


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
    group: BroadcastSpec | None = None
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
