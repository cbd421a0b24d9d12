"""Fused seeded sampling on CUDA: one pass over the logits, no ``[B, vocab]`` temporaries.

Computes what `rayrl.rollout.sampling.reference_sample_tokens` defines for
greedy and plain temperature sampling. Each program takes one row and one slice of the
vocabulary and walks it in blocks of ``BLOCK`` tokens, one token per lane and block, with
no reduction inside the loop: every lane keeps its own running max and sum of
exponentials (for the log-probability), and its best and second-best float32 estimate of
the Gumbel key ``score + noise``. The logits are scaled by the temperature (an IEEE
division, as torch does; skipped at temperature 1, where it is the identity), and the
noise comes from splitmix64 over ``(row seed, token)`` in 64-bit integers, the counter
advanced by one addition per block.

The definition's keys are float64 (two float64 logs per token); the float32 estimate is
within 4e-5 plus float32 rounding of them. After the loop, only the lanes whose best
estimate comes within a safe margin of the slice's top estimate can hold the winner:
their float64 keys are computed (one scalar token in the common case), and the winner
is the best exact key, the lowest token id on ties. A lane whose *second* estimate is
also within the margin (rare: two near-tied tokens in one lane) sends the program to an
exact float64 pass over its slice. A second kernel merges the slices: each row's token,
and its log-probability ``score - logsumexp(scores)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from rayrl.rollout.sampling import SamplingParams

__all__ = ["fused_sample", "fused_sample_packed"]

_SLICE = 8192  # vocabulary entries per program
_BLOCK = 512  # lanes of a program: tokens per loop iteration (the fastest of 7
# (slice, lanes, warps) settings on the H200: docs/benchmarks.md, rollout run 5)
_WARPS = 4
_GOLDEN = tl.constexpr(0x9E3779B97F4A7C15)  # the constants of sampling.py, as uint64
_MUL1 = tl.constexpr(0xBF58476D1CE4E5B9)
_MUL2 = tl.constexpr(0x94D049BB133111EB)
_SALT = tl.constexpr(0xD6E8FEB86659FD93)
_NO_TOKEN = tl.constexpr(2**31 - 1)
_MARGIN = 1e-3  # candidates: estimates within _MARGIN * (1 + |top| / 100) of the top one


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
    One float32 log serves both cases.
    """
    v = (h >> 11).to(tl.float64) + 0.5
    u = (v * 1.1102230246251565e-16).to(tl.float32)  # 2**-53
    w = ((9007199254740992.0 - v) * 1.1102230246251565e-16).to(tl.float32)  # 1 - u
    low = u < 0.5
    e = -tl.log(tl.where(low, u, 1.0 - w))
    e = tl.where(low | (w >= 0.0009765625), e, w * (1.0 + 0.5 * w))
    return s - tl.log(e)


@triton.jit
def _scores(LOGITS, tokens, live, temperature, SCALE: tl.constexpr):
    s = tl.load(LOGITS + tokens, mask=live, other=float("-inf")).to(tl.float32)
    if SCALE:
        s = tl.math.div_rn(s, temperature)
    return s


@triton.jit
def _exact_slice(
    LOGITS,
    seed,
    lo,
    vocab,
    temperature,
    SCALE: tl.constexpr,
    SLICE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """(best float64 key, its token) over the slice, every key exact (the rare path)."""
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float64)
    best_at = tl.full([BLOCK], _NO_TOKEN, tl.int32)
    for c in range(lo, lo + SLICE, BLOCK):
        tokens = c + lanes
        live = tokens < vocab
        s = _scores(LOGITS, tokens, live, temperature, SCALE)
        h = _mix64(seed + (tokens + 1).to(tl.uint64) * _GOLDEN)
        key = tl.where(live, _gumbel_keys(h, s), float("-inf"))
        better = key > best
        best = tl.where(better, key, best)
        best_at = tl.where(better, tokens, best_at)
    top = tl.max(best, axis=0)
    return top, tl.min(tl.where(best == top, best_at, _NO_TOKEN), axis=0)


@triton.jit
def _sample_kernel(
    LOGITS,
    KEYS,
    POSITIONS,
    BEST,
    BEST_AT,
    MAX,
    SUM,
    stride_row,
    vocab,
    temperature,
    margin,
    GREEDY: tl.constexpr,
    SCALE: tl.constexpr,
    SLICE: tl.constexpr,
    BLOCK: tl.constexpr,
    PARTS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    LOGITS += row * stride_row
    key = tl.load(KEYS + row).to(tl.uint64, bitcast=True)
    pos = tl.load(POSITIONS + row).to(tl.uint64, bitcast=True)
    seed = _mix64(key ^ _mix64(pos * _SALT + _GOLDEN))  # sampling.row_seeds
    lanes = tl.arange(0, BLOCK)
    lo = part * SLICE
    run_max = tl.full([BLOCK], float("-inf"), tl.float32)
    run_sum = tl.zeros([BLOCK], tl.float32)
    top = tl.full([BLOCK], float("-inf"), tl.float32)  # per lane: best key (estimate)
    top_at = tl.full([BLOCK], 0, tl.int32)
    second = tl.full([BLOCK], float("-inf"), tl.float32)  # per lane: the runner-up
    counter = seed + (lo + lanes + 1).to(tl.uint64) * _GOLDEN  # the hash input of token lo + lane
    stride = tl.full([], BLOCK, tl.uint64) * _GOLDEN  # (wraps, as the counter does)
    for c in range(lo, lo + SLICE, BLOCK):
        tokens = c + lanes
        live = tokens < vocab
        s = _scores(LOGITS, tokens, live, temperature, SCALE)
        new_max = tl.maximum(run_max, s)
        grown = run_sum * tl.exp(run_max - new_max) + tl.exp(s - new_max)
        run_sum = tl.where(new_max == float("-inf"), 0.0, grown)
        run_max = new_max
        if GREEDY:
            est = s
        else:
            est = tl.where(live, _gumbel_screen(_mix64(counter), s), float("-inf"))
            counter += stride
        better = est > top
        second = tl.where(better, top, tl.maximum(second, est))
        top_at = tl.where(better, tokens, top_at)
        top = tl.where(better, est, top)
    best_est = tl.max(top, axis=0)
    if GREEDY:
        best = best_est.to(tl.float64)
        best_at = tl.min(tl.where(top == best_est, top_at, _NO_TOKEN), axis=0)
        best_at = tl.where(best_at == _NO_TOKEN, 0, best_at)  # NaN rows
    else:
        # The winner's estimate is within twice the estimate's error (<< margin) of the
        # top estimate: only lanes at least that close can hold it.
        margin = margin * (1.0 + 0.01 * tl.abs(best_est))
        floor = tl.where(best_est == float("inf"), best_est, best_est - margin)
        near = top >= floor
        if tl.max(second, axis=0) >= floor:  # two candidates in one lane
            best, best_at = _exact_slice(LOGITS, seed, lo, vocab, temperature, SCALE, SLICE, BLOCK)
        elif tl.sum(near.to(tl.int32), axis=0) == 1:  # the common case: one token
            best_at = tl.min(tl.where(near, top_at, _NO_TOKEN), axis=0)
            one = _scores(LOGITS, best_at, best_at < vocab, temperature, SCALE)
            best = _gumbel_keys(_mix64(seed + (best_at + 1).to(tl.uint64) * _GOLDEN), one)
        else:
            some = _scores(LOGITS, top_at, near, temperature, SCALE)
            exact = _gumbel_keys(_mix64(seed + (top_at + 1).to(tl.uint64) * _GOLDEN), some)
            exact = tl.where(near, exact, float("-inf"))
            best = tl.max(exact, axis=0)
            best_at = tl.min(tl.where(near & (exact == best), top_at, _NO_TOKEN), axis=0)
        best_at = tl.where(best_at == _NO_TOKEN, 0, best_at)  # NaN rows
    slice_max = tl.max(run_max, axis=0)
    parts = tl.where(run_max == float("-inf"), 0.0, run_sum * tl.exp(run_max - slice_max))
    out = row * PARTS + part
    tl.store(BEST + out, best)
    tl.store(BEST_AT + out, best_at.to(tl.int64))
    tl.store(MAX + out, slice_max)
    tl.store(SUM + out, tl.sum(parts, axis=0))


@triton.jit
def _combine_kernel(
    LOGITS,
    BEST,
    BEST_AT,
    MAX,
    SUM,
    OUT,
    stride_row,
    rows,
    temperature,
    SCALE: tl.constexpr,
    PARTS: tl.constexpr,
    PARTS_PAD: tl.constexpr,
):
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
    if SCALE:
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
    scale = temperature != 1.0  # x / 1.0 == x: skip the division
    _sample_kernel[(rows, parts)](
        logits,
        keys,
        positions,
        best,
        best_at,
        run_max,
        run_sum,
        logits.stride(0),
        vocab,
        temperature,
        _MARGIN,
        GREEDY=greedy,
        SCALE=scale,
        SLICE=_SLICE,
        BLOCK=_BLOCK,
        PARTS=parts,
        num_warps=_WARPS,
    )
    _combine_kernel[(rows,)](
        logits,
        best,
        best_at,
        run_max,
        run_sum,
        out,
        logits.stride(0),
        rows,
        temperature,
        SCALE=scale,
        PARTS=parts,
        PARTS_PAD=triton.next_power_of_2(parts),
    )
    return out


def fused_sample(
    logits: Tensor, keys: Tensor, positions: Tensor, params: SamplingParams
) -> tuple[Tensor, Tensor]:
    """``(tokens [B] int64, log_probs [B] float32)`` for greedy or plain temperature sampling."""
    out = fused_sample_packed(logits, keys, positions, params)
    return out[0].long(), out[1].float()
