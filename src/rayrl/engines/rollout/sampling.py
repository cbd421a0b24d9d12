"""Sampling parameters and seeded, replayable token sampling for rollout engines.

Every random draw of a rollout comes from a counter-based hash, never from a
process-global RNG stream: the noise for token ``v`` at decode position ``t`` of a
sample is a pure function of ``(seed, step, sample uid, t, v)``. A replayed step thus
samples the same tokens in any process, on any device, whatever the batch it lands in,
its row order, or how it was split across workers.

How a token is drawn (Gumbel-max, exact for categorical sampling):

1. ``process_logits``: logits / temperature, then top-k, then top-p (``-inf`` for the
   tokens they remove). This is the distribution the sample comes from.
2. ``sample_keys``: one 64-bit key per sample, a BLAKE2b digest of ``(seed, step, uid)``.
3. ``uniform_noise``: splitmix64 over the counter ``(key, t, v)``, done in int64 with
   wrap-around multiplication and masked (logical) shifts; the top 53 bits give a
   float64 uniform strictly inside (0, 1).
4. token = argmax(processed logits + Gumbel noise), Gumbel = ``-log(-log(u))``. The
   log-prob recorded is ``log_softmax(processed logits)`` at that token.

Greedy decoding (``do_sample=False`` or temperature 0) takes the argmax of the raw
logits and records log-probs under ``softmax(logits)`` (temperature 1, no filtering),
which is what a trainer recomputes for a greedy rollout.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "SamplingParams",
    "mix64",
    "process_logits",
    "sample_keys",
    "sample_tokens",
    "uniform_noise",
]

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    """The int64 two's-complement value of a 64-bit unsigned constant."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)  # splitmix64 increment
_MUL1 = _signed(0xBF58476D1CE4E5B9)
_MUL2 = _signed(0x94D049BB133111EB)
_POSITION_SALT = _signed(0xD6E8FEB86659FD93)
_TWO_POW_M53 = 2.0**-53
_NOISE_CHUNK_ELEMENTS = 1 << 24  # rows x vocab per noise chunk: ~128 MB per int64 buffer


@dataclass(frozen=True)
class SamplingParams:
    """How to sample responses; one set for a whole `generate` call.

    Attributes:
        n: samples per prompt (adjacent in the output).
        temperature: logits are divided by it; 0 means greedy.
        top_p: keep the smallest set of most likely tokens whose mass reaches top_p (1: off).
        top_k: keep the k most likely tokens (0 or negative: off).
        max_new_tokens: the response length R; longer responses end with "length".
        stop_token_ids: extra ids that end a response, besides the model's EOS ids.
        stop: strings that end a response (optional; the engine needs a tokenizer).
        do_sample: False decodes greedily whatever the temperature.
        seed: run seed; with the step and each sample's uid it fixes every draw.
        ignore_eos: do not stop at the model's EOS ids (fixed-length benchmarks).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    do_sample: bool = True
    seed: int = 0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in self.stop_token_ids))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        checks = [
            (self.n >= 1, f"n={self.n} must be at least 1"),
            (self.temperature >= 0, f"temperature={self.temperature} must be >= 0 (0: greedy)"),
            (0 < self.top_p <= 1, f"top_p={self.top_p} must be in (0, 1] (1: off)"),
            (self.max_new_tokens >= 1, f"max_new_tokens={self.max_new_tokens} must be >= 1"),
            (all(i >= 0 for i in self.stop_token_ids), "stop_token_ids must be non-negative"),
            (all(s for s in self.stop), "stop strings must be non-empty"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"SamplingParams: {message}.")

    @property
    def greedy(self) -> bool:
        """True when tokens are the argmax of the raw logits (no randomness)."""
        return not self.do_sample or self.temperature == 0


def sample_keys(seed: int, step: int, sample_uids: Sequence[str]) -> Tensor:
    """One int64 key per sample: BLAKE2b of ``(seed, step, uid)``, stable across processes."""
    keys = []
    for uid in sample_uids:
        text = json.dumps([int(seed), int(step), str(uid)], separators=(",", ":"))
        digest = hashlib.blake2b(text.encode(), digest_size=8, person=b"rayrl-rollout").digest()
        keys.append(int.from_bytes(digest, "little", signed=True))
    return torch.tensor(keys, dtype=torch.int64).reshape(len(keys))


def _shift_right(x: Tensor, bits: int) -> Tensor:
    """Logical right shift of int64 values seen as unsigned 64-bit words."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(x: Tensor) -> Tensor:
    """The splitmix64 finaliser on int64 tensors (wrap-around arithmetic), elementwise."""
    x = x ^ _shift_right(x, 30)  # a new tensor: the input is never modified
    x.mul_(_MUL1)
    x.bitwise_xor_(_shift_right(x, 27)).mul_(_MUL2)
    return x.bitwise_xor_(_shift_right(x, 31))


def uniform_noise(keys: Tensor, positions: Tensor | int, vocab_size: int) -> Tensor:
    """Uniforms in (0, 1), float64 ``[B, vocab]``, a pure function of (key, position, token).

    Args:
        keys: ``[B]`` int64 sample keys from `sample_keys`.
        positions: decode position of each row (``[B]`` or one int for all rows).
        vocab_size: number of token ids.
    """
    positions = torch.as_tensor(positions, dtype=torch.int64, device=keys.device)
    row = mix64(keys ^ mix64(positions * _POSITION_SALT + _GOLDEN)).reshape(-1, 1)
    tokens = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=keys.device) * _GOLDEN
    bits = _shift_right(mix64(row + tokens), 11)  # top 53 bits, in [0, 2**53)
    return (bits.to(torch.float64) + 0.5) * _TWO_POW_M53


def process_logits(logits: Tensor, params: SamplingParams) -> Tensor:
    """Float32 logits of the sampling distribution: temperature, then top-k, then top-p.

    Removed tokens get ``-inf``. Greedy params return the raw logits (as float32).
    """
    scores = logits.float()
    if params.greedy:
        return scores
    scores = scores / params.temperature
    if 0 < params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before > params.top_p
        drop_sorted[..., 0] = False  # the most likely token always stays
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores


def sample_tokens(
    logits: Tensor, keys: Tensor, positions: Tensor | int, params: SamplingParams
) -> tuple[Tensor, Tensor]:
    """Draw one token per row; return ``(tokens [B] int64, log_probs [B] float32)``.

    Args:
        logits: ``[B, vocab]`` raw next-token logits.
        keys: ``[B]`` int64 sample keys (`sample_keys`), on any device.
        positions: decode position of each row (0 for the first response token).
        params: the sampling parameters.
    """
    scores = process_logits(logits, params)
    if params.greedy:
        tokens = scores.argmax(dim=-1)
    else:
        tokens = _gumbel_argmax(scores, keys.to(scores.device), positions)
    log_probs = torch.log_softmax(scores, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, log_probs


def _gumbel_argmax(scores: Tensor, keys: Tensor, positions: Tensor | int) -> Tensor:
    """argmax(scores + Gumbel noise) per row, a few rows at a time (bounded memory)."""
    n_rows, vocab = scores.shape
    positions = torch.as_tensor(positions, dtype=torch.int64, device=keys.device)
    positions = positions.expand(n_rows) if positions.dim() == 0 else positions
    tokens = torch.empty(n_rows, dtype=torch.int64, device=scores.device)
    step = max(1, _NOISE_CHUNK_ELEMENTS // vocab)
    for start in range(0, n_rows, step):
        rows = slice(start, start + step)
        noise = uniform_noise(keys[rows], positions[rows], vocab)
        gumbel = noise.log_().neg_().log_().neg_()
        tokens[rows] = gumbel.add_(scores[rows]).argmax(dim=-1)
    return tokens
