"""Fused seeded sampling on CUDA: one pass over the logits, no ``[B, vocab]`` temporaries.

Computes what `rayrl.engines.rollout.sampling.reference_sample_tokens` defines for
greedy and plain temperature sampling: each program takes one row and one slice of
the vocabulary, scales the logits (an IEEE division by the temperature, as torch does),
hashes ``(row seed, token)`` with splitmix64 in 64-bit integers, and keeps the slice's
best ``score + Gumbel noise`` (first index on ties) with a running max and sum of
exponentials. The float64 noise of the definition (two float64 logs per token) is only
computed for blocks of 1024 tokens whose float32 estimate, accurate to 1e-4, comes
within a safe margin of the best exact key found so far; other blocks cannot hold the
winner. A second kernel merges the slices: each row's token, and its log-probability
``score - logsumexp(scores)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from rayrl.engines.rollout.sampling import SamplingParams

__all__ = ["fused_sample", "fused_sample_packed"]

_SLICE = 8192  # vocabulary entries per program
_BLOCK = 1024
_GOLDEN = tl.constexpr(0x9E3779B97F4A7C15)  # the constants of sampling.py, as uint64
_MUL1 = tl.constexpr(0xBF58476D1CE4E5B9)
_MUL2 = tl.constexpr(0x94D049BB133111EB)
_SALT = tl.constexpr(0xD6E8FEB86659FD93)


@triton.jit
def _mix64(x):
    x = (x ^ (x >> 30)) * _MUL1
    x = (x ^ (x >> 27)) * _MUL2
    return x ^ (x >> 31)


@triton.jit
def _gumbel_keys(h, s):
    """float64 ``s - log(-log(u))`` of the definition, u from the hash's top 53 bits."""
    u = ((h >> 11).to(tl.float64) + 0.5) * 1.1102230246251565e-16  # 2**-53
    return -tl.log(-tl.log(u)) + s.to(tl.float64)


@triton.jit
def _gumbel_screen(h, s):
    """A float32 estimate of `_gumbel_keys`: off by at most 4e-5 plus float32 rounding.

    The float64 uniform is formed as in the definition (its rounding near 1 included),
    then -log(u) is taken from u when u < 1/2, else from w = 1 - u (exact in float64),
    so the estimate stays accurate where -log(u) is tiny (+inf where u rounds to 1).
    """
    v = (h >> 11).to(tl.float64) + 0.5
    u = (v * 1.1102230246251565e-16).to(tl.float32)  # 2**-53
    w = ((9007199254740992.0 - v) * 1.1102230246251565e-16).to(tl.float32)  # 1 - u
    e = tl.where(w < 0.0009765625, w * (1.0 + 0.5 * w), -tl.log(1.0 - w))
    e = tl.where(u < 0.5, -tl.log(u), e)
    return s - tl.log(e)


@triton.jit
def _sample_kernel(
    LOGITS, KEYS, POSITIONS, BEST, BEST_AT, MAX, SUM, stride_row, vocab, temperature,
    GREEDY: tl.constexpr, SLICE: tl.constexpr, BLOCK: tl.constexpr, PARTS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    key = tl.load(KEYS + row).to(tl.uint64, bitcast=True)
    pos = tl.load(POSITIONS + row).to(tl.uint64, bitcast=True)
    seed = _mix64(key ^ _mix64(pos * _SALT + _GOLDEN))  # sampling.row_seeds
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
        run_sum = run_sum * scale + tl.sum(tl.where(live, tl.exp(s - new_max), 0.0), axis=0)
        run_max = new_max
        if GREEDY:
            key64 = s.to(tl.float64)
            block_best = tl.max(key64, axis=0)
            block_at = tl.argmax(key64, axis=0).to(tl.int64) + c
            better = block_best > best
            best = tl.where(better, block_best, best)
            best_at = tl.where(better, block_at, best_at)
        else:
            h = _mix64(seed + (tokens + 1).to(tl.uint64) * _GOLDEN)
            screen = tl.where(live, _gumbel_screen(h, s), float("-inf"))
            top = tl.max(screen, axis=0)
            # Only a block whose estimate comes near the best exact key so far can hold
            # the winner: compute the float64 keys of that block alone.
            if top + 1e-3 + 1e-5 * tl.abs(top) >= best:
                key64 = tl.where(live, _gumbel_keys(h, s), float("-inf"))
                block_best = tl.max(key64, axis=0)
                block_at = tl.argmax(key64, axis=0).to(tl.int64) + c
                better = block_best > best
                best = tl.where(better, block_best, best)
                best_at = tl.where(better, block_at, best_at)
    out = row * PARTS + part
    tl.store(BEST + out, best)
    tl.store(BEST_AT + out, best_at)
    tl.store(MAX + out, run_max)
    tl.store(SUM + out, run_sum)


@triton.jit
def _combine_kernel(
    LOGITS, BEST, BEST_AT, MAX, SUM, OUT, stride_row, rows, temperature,
    GREEDY: tl.constexpr, PARTS: tl.constexpr, PARTS_PAD: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, PARTS_PAD)
    live = p < PARTS
    best = tl.load(BEST + row * PARTS + p, mask=live, other=float("-inf"))
    at = tl.load(BEST_AT + row * PARTS + p, mask=live, other=0)
    m = tl.load(MAX + row * PARTS + p, mask=live, other=float("-inf"))
    total = tl.load(SUM + row * PARTS + p, mask=live, other=0.0)
    winner = tl.argmax(best, axis=0)  # first slice on ties: the lowest token id
    token = tl.sum(tl.where(p == winner, at, 0), axis=0)
    top = tl.max(m, axis=0)
    lse = top + tl.log(tl.sum(tl.where(live, total * tl.exp(m - top), 0.0), axis=0))
    chosen = tl.load(LOGITS + row * stride_row + token).to(tl.float32)
    if not GREEDY:
        chosen = tl.math.div_rn(chosen, temperature)
    tl.store(OUT + row, token.to(tl.float64))
    tl.store(OUT + rows + row, (chosen - lse).to(tl.float64))


def fused_sample_packed(
    logits: Tensor, keys: Tensor, positions: Tensor, params: SamplingParams
) -> Tensor:
    """float64 ``[2, B]``: sampled token ids, then their log-probs (one tensor to copy back)."""
    rows, vocab = logits.shape
    dev = logits.device
    out = torch.empty(2, rows, dtype=torch.float64, device=dev)
    if rows == 0:
        return out
    parts = triton.cdiv(vocab, _SLICE)
    best = torch.empty(rows, parts, dtype=torch.float64, device=dev)
    best_at = torch.empty(rows, parts, dtype=torch.int64, device=dev)
    run_max = torch.empty(rows, parts, dtype=torch.float32, device=dev)
    run_sum = torch.empty(rows, parts, dtype=torch.float32, device=dev)
    greedy = params.greedy
    temperature = 1.0 if greedy else float(params.temperature)
    _sample_kernel[(rows, parts)](
        logits, keys, positions, best, best_at, run_max, run_sum, logits.stride(0), vocab,
        temperature, GREEDY=greedy, SLICE=_SLICE, BLOCK=_BLOCK, PARTS=parts,
    )  # fmt: skip
    _combine_kernel[(rows,)](
        logits, best, best_at, run_max, run_sum, out, logits.stride(0), rows, temperature,
        GREEDY=greedy, PARTS=parts, PARTS_PAD=triton.next_power_of_2(parts),
    )  # fmt: skip
    return out


def fused_sample(
    logits: Tensor, keys: Tensor, positions: Tensor, params: SamplingParams
) -> tuple[Tensor, Tensor]:
    """``(tokens [B] int64, log_probs [B] float32)`` for greedy or plain temperature sampling."""
    out = fused_sample_packed(logits, keys, positions, params)
    return out[0].long(), out[1].float()
