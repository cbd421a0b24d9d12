"""The paged KV cache: one preallocated tensor of fixed-size blocks, and their allocator.

``data`` is ``[layers, 2 (k, v), blocks, block_size, kv_heads, head_dim]``, allocated
once and freed whole by `KVCache.free` (the engine's ``sleep``). On CUDA it lives at an
address fixed for the cache's life (`vmm.VirtualBuffer`: its pages are given back at
`free` and taken again at `allocate`), so CUDA graphs captured over it stay valid
across a sleep (`fixed_address`); where the driver cannot, torch allocates it. A sequence owns a list
of block ids; blocks are reference-counted so that the n samples of one prompt share
the blocks of its prefill (`BlockAllocator.share`), each getting its own copy of the
last, partly filled block (`KVCache.copy_blocks`).

`cache_blocks_for` sizes the cache from ``gpu_memory_utilization`` on CUDA the way vLLM
does: the engine may use that fraction of the device's memory in all, weights and
activations included; the rest of it becomes KV blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import Tensor

from rayrl.rollout.native.spec import ModelSpec

__all__ = ["BlockAllocator", "KVCache", "cache_blocks_for"]


class KVCache:
    """Block storage for every layer's keys and values."""

    def __init__(
        self, spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype, device
    ) -> None:
        self.spec, self.num_blocks, self.block_size = spec, num_blocks, block_size
        self.dtype, self.device = dtype, torch.device(device)
        self.data: Tensor | None = None
        self._buffer = None
        if self.device.type == "cuda":
            from rayrl.rollout.native.vmm import VirtualBuffer

            self._buffer = VirtualBuffer.create(self.nbytes, self.device)
        self.allocate()

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_size * self.spec.kv_bytes_per_token(self.dtype)

    @property
    def allocated(self) -> bool:
        return self.data is not None

    @property
    def fixed_address(self) -> bool:
        """Whether `allocate` after `free` puts the cache at the same address."""
        return self._buffer is not None

    def allocate(self) -> None:
        if self.data is None:
            s = self.spec
            shape = (s.layers, 2, self.num_blocks, self.block_size, s.kv_heads, s.head_dim)
            if self._buffer is None:
                self.data = torch.empty(shape, dtype=self.dtype, device=self.device)
            else:
                self._buffer.map()
                self.data = self._buffer.tensor(shape, self.dtype)

    def free(self) -> None:
        self.data = None
        if self._buffer is not None:
            self._buffer.release()

    def layer(self, index: int) -> tuple[Tensor, Tensor]:
        """``(k, v)`` of one layer, each ``[blocks, block_size, kv_heads, head_dim]``."""
        data = self._live()
        return data[index, 0], data[index, 1]

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy blocks ``src[i]`` to ``dst[i]`` in every layer, keys and values."""
        if src:
            data, index = self._live(), torch.tensor(src, device=self.device)
            data[:, :, torch.tensor(dst, device=self.device)] = data[:, :, index]

    def _live(self) -> Tensor:
        if self.data is None:
            raise RuntimeError("the KV cache is freed (the engine sleeps): allocate() it first")
        return self.data


class BlockAllocator:
    """Free blocks and reference counts of the cache's blocks.

    A block nobody owns goes back to the free pool with its content intact, and the
    pool hands out the longest-free block first: a block a prefix cache knows
    (`rayrl.rollout.native.prefix_cache`) can be claimed again (`claim`) until
    it is handed out for something else, which tells the cache (``on_evict``).
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._refs = [0] * num_blocks
        self.on_evict: Callable[[int], None] | None = None

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int] | None:
        """``count`` fresh blocks, or None (nothing taken) if fewer are free."""
        if count > len(self._free):
            return None
        blocks = [self._free.popitem(last=False)[0] for _ in range(count)]
        for b in blocks:
            self._refs[b] = 1
            if self.on_evict is not None:
                self.on_evict(b)
        return blocks

    def claim(self, block: int) -> None:
        """One more owner for ``block``, taken out of the free pool if it was there (a
        prefix cache's hit)."""
        if self._refs[block] == 0:
            del self._free[block]
        self._refs[block] += 1

    def is_free(self, block: int) -> bool:
        return self._refs[block] == 0

    def share(self, blocks: list[int]) -> list[int]:
        """Another owner for ``blocks`` (no copy); returns them."""
        for b in blocks:
            self._refs[b] += 1
        return list(blocks)

    def release(self, blocks: list[int]) -> None:
        """Drop one owner of each block; blocks nobody owns become free, last in line,
        a sequence's tail before its head: its head (the prefix later sequences share)
        is handed out last."""
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free[b] = None


def cache_blocks_for(
    spec: ModelSpec,
    dtype: torch.dtype,
    block_size: int,
    *,
    device: torch.device,
    gpu_memory_utilization: float,
    engine_bytes: int,
    cpu_cache_tokens: int,
    max_blocks: int | None = None,
    extra_bytes_per_token: int = 0,
) -> int:
    """Number of KV blocks to allocate.

    On CUDA: ``utilization * total memory - engine_bytes`` (the engine's weights plus its
    peak activations), capped by what is free now, in blocks, and by ``max_blocks``
    (what the engine's sequences can ever use: allocating more only costs time at every
    wake, as the cache is freed between rollouts). Elsewhere: room for
    ``cpu_cache_tokens`` tokens. ``extra_bytes_per_token``: what the engine keeps per
    cache slot beside the keys and values (the routing record, `routes`).

    Raises:
        RuntimeError: not even one block fits (with the numbers and what to change).
    """
    per_block = block_size * (spec.kv_bytes_per_token(dtype) + extra_bytes_per_token)
    if torch.device(device).type != "cuda":
        return max(1, -(-cpu_cache_tokens // block_size))
    free, total = torch.cuda.mem_get_info(device)
    budget = min(gpu_memory_utilization * total - engine_bytes, free - (256 << 20))
    blocks = int(budget // per_block)
    if max_blocks is not None and blocks > max_blocks:
        blocks = max_blocks
    if blocks < 1:
        raise RuntimeError(
            f"native rollout engine: no room for a KV cache on {device}: "
            f"gpu_memory_utilization={gpu_memory_utilization} of {total / 2**30:.1f} GiB leaves "
            f"{budget / 2**30:.2f} GiB after the engine's own {engine_bytes / 2**30:.2f} GiB "
            f"({free / 2**30:.1f} GiB free now). Raise actor_rollout_ref.rollout."
            "gpu_memory_utilization or free memory (offload the trainer, sleep other engines)."
        )
    return blocks
