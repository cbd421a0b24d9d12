"""Fused seeded sampling on CUDA: one pass over the logits, no ``[B, vocab]`` temporaries.

Computes what `rayrl.engines.rollout.sampling.reference_sample_tokens` defines for
greedy and plain temperature sampling: each program takes one row and one slice of
the vocabulary, scales the logits (an IEEE division by the temperature, as torch does),
hashes ``(row seed, token)`` with splitmix64 in 64-bit integers, turns the top 53 bits
into the float64 uniform and Gumbel noise of the definition, and keeps the slice's
best ``score + noise`` (first index on ties) together with a running max and sum of
exponentials. A few torch operations on ``[B, slices]`` then pick each row's token and
its log-probability ``score - logsumexp(scores)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from rayrl.engines.rollout.sampling import SamplingParams, row_seeds

__all__ = ["fused_sample"]

_SLICE = 8192  # vocabulary entries per program
_BLOCK = 1024


@triton.jit
def _sample_kernel(
    LOGITS, SEEDS, BEST, BEST_AT, MAX, SUM, stride_row, vocab, temperature,
    GREEDY: tl.constexpr, SLICE: tl.constexpr, BLOCK: tl.constexpr, PARTS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    seed = tl.load(SEEDS + row).to(tl.uint64, bitcast=True)
    best = tl.full([], float("-inf"), tl.float64)
    best_at = tl.full([], 0, tl.int64)
    run_max = tl.full([], float("-inf"), tl.float32)
    run_sum = tl.full([], 0.0, tl.float32)
    lo = part * SLICE
    for c in range(lo, lo + SLICE, BLOCK):
        tokens = c + tl.arange(0, BLOCK)
        live = tokens < vocab
        x = tl.load(LOGITS + row * stride_row + tokens, mask=live, other=float("-inf"))
        s = x.to(tl.float32)
        if not GREEDY:
            s = tl.math.div_rn(s, temperature)
        block_max = tl.max(s, axis=0)
        new_max = tl.maximum(run_max, block_max)
        scale = tl.where(new_max == float("-inf"), 0.0, tl.exp(run_max - new_max))
        shifted = tl.where(live, tl.exp(s - new_max), 0.0)
        run_sum = run_sum * scale + tl.sum(shifted, axis=0)
        run_max = new_max
        if GREEDY:
            key = s.to(tl.float64)
        else:
            h = seed + (tokens + 1).to(tl.uint64) * 0x9E3779B97F4A7C15
            h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9
            h = (h ^ (h >> 27)) * 0x94D049BB133111EB
            h = h ^ (h >> 31)
            u = ((h >> 11).to(tl.float64) + 0.5) * 1.1102230246251565e-16  # 2**-53
            key = -tl.log(-tl.log(u)) + s.to(tl.float64)
        key = tl.where(live, key, float("-inf"))
        block_best = tl.max(key, axis=0)
        block_at = tl.argmax(key, axis=0).to(tl.int64) + c
        better = block_best > best
        best = tl.where(better, block_best, best)
        best_at = tl.where(better, block_at, best_at)
    out = row * PARTS + part
    tl.store(BEST + out, best)
    tl.store(BEST_AT + out, best_at)
    tl.store(MAX + out, run_max)
    tl.store(SUM + out, run_sum)


def fused_sample(
    logits: Tensor, keys: Tensor, positions: Tensor, params: SamplingParams
) -> tuple[Tensor, Tensor]:
    """``(tokens [B] int64, log_probs [B] float32)`` for greedy or plain temperature sampling."""
    rows, vocab = logits.shape
    if rows == 0:
        return torch.zeros(0, dtype=torch.int64, device=logits.device), logits.new_zeros(0).float()
    parts = triton.cdiv(vocab, _SLICE)
    dev = logits.device
    best = torch.empty(rows, parts, dtype=torch.float64, device=dev)
    best_at = torch.empty(rows, parts, dtype=torch.int64, device=dev)
    run_max = torch.empty(rows, parts, dtype=torch.float32, device=dev)
    run_sum = torch.empty(rows, parts, dtype=torch.float32, device=dev)
    greedy = params.greedy
    seeds = row_seeds(keys, positions) if not greedy else keys
    temperature = 1.0 if greedy else float(params.temperature)
    _sample_kernel[(rows, parts)](
        logits, seeds, best, best_at, run_max, run_sum, logits.stride(0), vocab, temperature,
        GREEDY=greedy, SLICE=_SLICE, BLOCK=_BLOCK, PARTS=parts,
    )  # fmt: skip
    winner = best.argmax(dim=1, keepdim=True)  # first slice on ties: lowest token id
    tokens = best_at.gather(1, winner).squeeze(1)
    top = run_max.max(dim=1, keepdim=True).values
    lse = top.squeeze(1) + torch.log((run_sum * torch.exp(run_max - top)).sum(dim=1))
    chosen = logits.gather(1, tokens.unsqueeze(1)).squeeze(1).float()
    if not greedy:
        chosen = chosen / params.temperature
    return tokens, chosen - lse
