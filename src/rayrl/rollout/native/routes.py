"""The native engine's record of the experts each token was routed to (mixture-of-experts
models, ``record_routes``), kept beside the KV cache, slot by slot.

Row ``s`` of a layer's record holds the top-k experts that layer chose for the token
whose keys and values live in KV cache slot ``s``: the routing of the forward that took
the token as input. Keeping it by slot makes the scheduler's block bookkeeping say where
every position's routing is, whatever path the position's KV took: the n samples of a
prompt share its prefill's blocks (each copies the last, partly filled one, and its
record with it: `copy_blocks`), a prefix-cache hit reuses blocks computed earlier under
the same weights (the cache is cleared at a weight update) with their record, a
preempted or reclaimed sample recomputed writes its positions again, and the tokens a
multi-turn episode appends are prefilled into the sample's own blocks.

Every mixture-of-experts layer of a step writes its choices at the step's slot mapping
(`write`: one ``index_put_`` of fixed shape, so CUDA graphs capture it with the rest of
the step); slot -1 (a padded row of a graph bucket) lands on the extra last row, which
nothing reads. When a sample finishes (`on_finish`, before the scheduler frees its
blocks), the rows of its positions are gathered into a tensor of its own on the device
(no host sync: the copy is queued behind the steps that wrote them, ahead of any step
that could reuse the blocks); `take` hands it over, and the caller brings it to the
host once the call is done. Positions without KV in the cache then (the last token,
never fed back; everything of a parked sample whose blocks were reclaimed) are marked
`rayrl.algos.routing.unrouted`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from rayrl.algos.routing import routes_dtype, unrouted
from rayrl.rollout.native.spec import MoESpec

if TYPE_CHECKING:
    from rayrl.rollout.native.scheduler import Scheduler

__all__ = ["RouteStore"]


class RouteStore:
    """Each KV cache slot's routing in every mixture-of-experts layer (module docstring).

    Args:
        moe: the model's mixture of experts (its layers, experts and top-k).
        slots: the KV cache's slots (blocks times block size).
        device: where the cache lives.
    """

    def __init__(self, moe: MoESpec, slots: int, device: torch.device) -> None:
        self.layer_of = {i: j for j, i in enumerate(np.flatnonzero(moe.layers).tolist())}
        self.dtype = routes_dtype(moe.experts)
        self.missing = unrouted(self.dtype)
        self.device = torch.device(device)
        shape = (len(self.layer_of), slots + 1, moe.top_k)  # + the row slot -1 writes
        self.data = torch.full(shape, self.missing, dtype=self.dtype, device=self.device)
        self.gathered: dict[int, Tensor] = {}

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    @staticmethod
    def bytes_per_slot(moe: MoESpec) -> int:
        """What each KV cache slot adds to the engine's memory with the record on."""
        size = torch.empty((), dtype=routes_dtype(moe.experts)).element_size()
        return sum(moe.layers) * moe.top_k * size

    def write(self, layer: int, slots: Tensor, chosen: Tensor) -> None:
        """Layer ``layer``'s top-k experts ``chosen`` ``[T, k]`` of the step's tokens,
        at their cache ``slots`` ``[T]``."""
        self.data[self.layer_of[layer]].index_put_((slots,), chosen.to(self.dtype))

    def copy_blocks(self, src: list[int], dst: list[int], block_size: int) -> None:
        """The record of blocks ``src[i]`` copied to blocks ``dst[i]`` (forks)."""
        offsets = np.arange(block_size)
        rows = [np.asarray(blocks)[:, None] * block_size + offsets for blocks in (src, dst)]
        src_rows, dst_rows = (self._to_device(r.reshape(-1)) for r in rows)
        self.data[:, dst_rows] = self.data[:, src_rows]

    def on_finish(self, sched: Scheduler, sample: int) -> None:
        """Gather ``sample``'s record while it still holds its blocks: ``[prompt +
        response, layers, k]``, unrouted past the positions with KV in the cache."""
        prompt = sched.prompt_of[sample]
        assert prompt is not None  # a live sample's prompt: released only after this
        length = len(prompt) + int(sched.gen[sample])
        cached = min(int(sched.kv_len[sample]), length)
        positions = np.arange(cached)
        blocks = np.asarray(sched.blocks[sample], dtype=np.int64)
        if cached and len(blocks) * sched.block_size < cached:
            raise RuntimeError(
                f"native rollout engine: sample {sample} has {cached} positions in the KV "
                f"cache but {len(blocks)} blocks of {sched.block_size}; this is a bug in "
                "rayrl's scheduler, please report it"
            )
        slots = (
            blocks[positions // sched.block_size] * sched.block_size + positions % sched.block_size
        )
        index = self._to_device(slots)
        layers, _, top_k = self.data.shape
        record = torch.full(
            (length, layers, top_k), self.missing, dtype=self.dtype, device=self.device
        )
        record[:cached] = self.data[:, index].transpose(0, 1)
        self.gathered[sample] = record

    def _to_device(self, array: np.ndarray) -> Tensor:
        """An int64 host array on the device, by a copy that never waits for the
        device's queue (pinned memory on CUDA)."""
        host = torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))
        if self.device.type == "cuda":
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    def take(self, sample: int) -> Tensor | None:
        """``sample``'s gathered record (on the device), once; None if it has none."""
        return self.gathered.pop(sample, None)

    def drop(self, samples) -> None:
        """Forget the records of ``samples`` that were never taken."""
        for s in samples:
            self.gathered.pop(int(s), None)
