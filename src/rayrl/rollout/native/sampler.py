"""Sampling on the device, with the draws of `rayrl.rollout.sampling`.

A token depends only on (seed, step, sample uid, position) and the logits, exactly as
in the HF engine: the same keys, the same splitmix64 noise, the same float64 Gumbel-max.
With Triton kernels (CUDA), greedy and plain temperature sampling run as one fused pass over the
logits (`rayrl.rollout.native.triton_sampler`: hash, Gumbel, running argmax and
logsumexp per vocabulary slice, no ``[B, vocab]`` temporaries); top-k / top-p, and every
case on CPU, go through `sample_tokens` (top-k candidates, chunked hashing). Tokens
and log-probs come back to the host in one copy, into pinned memory on CUDA, which the
host waits for only when it needs them (`fetch`, then `wait`).
"""

from __future__ import annotations

import time

import numpy as np
import torch
from torch import Tensor

from rayrl.rollout.sampling import SamplingParams, sample_tokens

__all__ = ["DeviceSampler"]


class DeviceSampler:
    """Draws one token per row of a logits matrix, on the device; brings them to the host."""

    def __init__(self, kernels: str) -> None:
        self.fused = None
        if kernels == "triton":
            from rayrl.rollout.native.triton_sampler import fused_sample_packed

            self.fused = fused_sample_packed
        self.wait_s = 0.0  # time spent waiting for the device's results

    def draw(
        self, logits: Tensor, keys: Tensor, positions: Tensor, params: SamplingParams
    ) -> Tensor:
        """float64 ``[2, B]`` on the logits' device: token ids, then their log-probs."""
        plain = params.greedy or (params.top_k <= 0 and params.top_p >= 1.0)
        if self.fused is not None and plain:
            return self.fused(logits, keys, positions, params)
        tokens, log_probs = sample_tokens(logits, keys, positions, params)
        return torch.stack([tokens.double(), log_probs.double()])

    @staticmethod
    def fetch(drawn: Tensor) -> tuple[Tensor, torch.cuda.Event | None]:
        """Start copying a draw to the host (pinned memory, not waited for, on CUDA)."""
        if drawn.device.type != "cuda":
            return drawn, None
        host = torch.empty(drawn.shape, dtype=drawn.dtype, pin_memory=True)
        host.copy_(drawn, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return host, ready

    def wait(self, host: Tensor, ready: torch.cuda.Event | None) -> tuple[np.ndarray, np.ndarray]:
        """``(tokens int64 [B], log_probs float32 [B])`` of a fetched draw, once it is there."""
        start = time.perf_counter()
        if ready is not None:
            ready.synchronize()
        both = host.numpy()
        self.wait_s += time.perf_counter() - start
        return both[0].astype(np.int64), both[1].astype(np.float32)

    def sample(
        self, logits: Tensor, keys: Tensor, positions: Tensor, params: SamplingParams
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(tokens int64 [B], log_probs float32 [B])`` on the host (waits for them)."""
        return self.wait(*self.fetch(self.draw(logits, keys, positions, params)))
