"""Policy versions between the trainer's actor rank 0 and the rollout replicas
(`rollout.mode=async`), by the object store or by a collective broadcast.

The sender (`publish_packed`, on actor rank 0) packs the stream of full weights into
buckets (`weight_sync.pack_buckets`) and always puts them into the object store: a
replica that joins later, or misses a broadcast, fetches that copy. With the
``collective`` transport it also broadcasts every bucket's flat tensor to the
replicas over the run's broadcast group (`rayrl.cluster.broadcast`; the names and
shapes ride in the header); a broadcast that fails or runs past its bound leaves the
group, and the version goes by the object store (`PublishedWeights.fallback` says why).

A replica (`receive_packed`) joins the group the offer names (leaving an older
formation), receives the buckets into buffers of its own on its device, and raises
`BroadcastError` when it cannot; the caller then fetches from the object store.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from rayrl.cluster.broadcast import BroadcastMember, BroadcastSpec
from rayrl.config.schema import WEIGHT_TRANSPORTS
from rayrl.train.weight_sync import PackedBucket, PublishedWeights, pack_buckets

__all__ = ["check_transport", "publish_packed", "receive_packed"]

log = logging.getLogger("rayrl.workers")


def check_transport(transport: str, where: str) -> None:
    """ValueError naming `where` unless `transport` is one rayrl has."""
    if transport not in WEIGHT_TRANSPORTS:
        raise ValueError(
            f"{where}: weight transport {transport!r} is not one of {', '.join(WEIGHT_TRANSPORTS)} "
            "(async_training.weight_transport)"
        )


def publish_packed(
    stream: Any,
    member: BroadcastMember,
    transport: str,
    group: BroadcastSpec | None,
    key: str,
    device: torch.device,
) -> PublishedWeights:
    """`stream` (``(name, tensor)`` pairs) packed, put into the object store, and with
    the collective transport broadcast over `group` as member 0 (module docstring)."""
    import ray

    buckets = list(pack_buckets(stream))
    refs = [ray.put(bucket) for bucket in buckets]
    published = PublishedWeights(refs, sum(b.nbytes for b in buckets))
    if transport != "collective" or group is None:  # None: no live replica to send to
        return published
    try:
        member.join(group, 0)
        wire = device if group.backend == "nccl" else torch.device("cpu")
        meta = [(b.names, b.shapes) for b in buckets]
        member.send(key, [b.flat.to(wire) for b in buckets], meta=meta)
    except Exception as err:  # noqa: BLE001 - any failure: that version by the object store
        member.drop()
        published.fallback = f"actor rank 0: {err}"
        log.warning("weights go by the object store this time: %s", err)
        return published
    published.transport, published.group, published.key = "collective", group, key
    return published


def receive_packed(
    member: BroadcastMember, offer: PublishedWeights, rank: int, device: torch.device
) -> list[PackedBucket]:
    """The buckets of a collective `offer`, received as member `rank` onto `device`;
    the group is left (and the error raised) when anything fails."""
    try:
        spec = offer.group
        if spec is None:  # publish_packed and begin_collective always name one
            raise ValueError(f"collective offer {offer.key!r} names no broadcast group")
        member.join(spec, rank)
        wire = device if spec.backend == "nccl" else torch.device("cpu")
        meta, flats = member.receive(offer.key, wire)
    except Exception:
        member.drop()
        raise
    return [
        PackedBucket(list(names), [tuple(s) for s in shapes], flat)
        for (names, shapes), flat in zip(meta, flats, strict=True)
    ]
