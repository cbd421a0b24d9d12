"""Training weights to the rollout engine: full tensors by name, in the rollout's dtype,
a bucket at a time.

`rollout_weights` walks the model's parameters in order and yields ``(name, tensor)``
pairs that a rollout engine's ``update_weights`` consumes as they come. A sharded
(FSDP2) parameter is cast to the rollout dtype *before* it is all-gathered, so the
gather moves bf16, not fp32, and no rank ever holds more than one bucket of gathered
tensors (``bucket_bytes``): never the whole fp32 state. An unsharded parameter is cast
(or, when it already has the dtype, handed over as it is, without a copy).

Names are the model's own (FSDP2 keeps Hugging Face names); tied parameters appear
once, under their first name.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

__all__ = ["DEFAULT_BUCKET_BYTES", "rollout_weights"]

DEFAULT_BUCKET_BYTES = 512 << 20


def _full(param: Tensor, dtype: torch.dtype) -> Tensor:
    """The whole tensor in ``dtype``: cast the local shard, then gather (a collective)."""
    data = param.detach()
    if hasattr(data, "full_tensor"):  # a DTensor (FSDP2 shard)
        return data.to(dtype).full_tensor()
    return data if data.dtype == dtype else data.to(dtype)


def rollout_weights(
    model: nn.Module, dtype: torch.dtype, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[tuple[str, Tensor]]:
    """``(name, full tensor in dtype)`` for every parameter, gathered bucket by bucket.

    Every rank of a sharded model must consume the whole iterator (each bucket's
    gathers are collectives).
    """
    bucket: list[tuple[str, Tensor]] = []
    size = 0
    for name, param in model.named_parameters():
        bucket.append((name, _full(param, dtype)))
        size += bucket[-1][1].numel() * bucket[-1][1].element_size()
        if size >= bucket_bytes:
            yield from bucket
            bucket, size = [], 0
    yield from bucket
