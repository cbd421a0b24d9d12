"""Sampling parameters and seeded, replayable token sampling for rollout engines.

Every random draw of a rollout comes from a counter-based hash, never from a
process-global RNG stream: the noise for token ``v`` at decode position ``t`` of a
sample is a pure function of ``(seed, step, sample uid, t, v)``. A replayed step thus
samples the same tokens in any process, on any device, whatever the batch it lands in,
its row order, or how it was split across workers.

The definition of a draw (Gumbel-max, exact for categorical sampling):

1. ``process_logits``: logits / temperature, then top-k, then top-p (``-inf`` for the
   tokens they remove). This is the distribution the sample comes from.
2. ``sample_keys``: one 64-bit key per sample, a BLAKE2b digest of ``(seed, step, uid)``.
3. ``uniform_noise``: splitmix64 over the counter ``(key, t, v)``, done in int64 with
   wrap-around multiplication and masked (logical) shifts; the top 53 bits give a
   float64 uniform strictly inside (0, 1).
4. token = argmax(processed logits + Gumbel noise), Gumbel = ``-log(-log(u))`` in
   float64. The log-prob recorded is ``log_softmax(processed logits)`` at that token.

`reference_sample_tokens` computes exactly that, over whole ``[B, vocab]`` tensors.
`sample_tokens` computes the same tokens cheaply: with top-k or top-p it hashes only
the surviving candidates (found with ``topk``, never a full sort unless top-p keeps
most of the vocabulary), and without filtering it walks the vocabulary in cache-sized
chunks, in place, keeping a running argmax; the log-prob comes from a logsumexp, with
no ``[B, vocab]`` log-softmax. The native engine's fused GPU kernel computes the same
function (`rayrl.rollout.native.sampler`).

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
    "reference_sample_tokens",
    "row_seeds",
    "sample_keys",
    "sample_tokens",
    "uniform_noise",
    "uniform_noise_at",
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
# Elements (rows x tokens) hashed at a time over the whole vocabulary: on CPU a chunk's
# int64 buffers stay in the L2 cache (much faster than whole-tensor passes:
# docs/benchmarks.md); on GPU big chunks keep launches few.
_NOISE_CHUNK_ELEMENTS = {"cpu": 1 << 16}
_NOISE_CHUNK_DEFAULT = 1 << 24
_TOP_P_FIRST_CANDIDATES = 64  # top-p looks at this many tokens first, doubling as needed


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

    def drawing(self) -> SamplingParams:
        """The settings a decode step draws and stops by (temperature, top-k, top-p,
        greedy, stop ids and strings), without the per-request ones (n, length, seed):
        requests decoded in one step must agree on these."""
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop_token_ids=self.stop_token_ids,
            stop=self.stop,
            do_sample=self.do_sample,
            ignore_eos=self.ignore_eos,
        )

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
    tokens = torch.arange(vocab_size, dtype=torch.int64, device=keys.device)
    return uniform_noise_at(keys, positions, tokens.expand(len(keys), -1))


def row_seeds(keys: Tensor, positions: Tensor | int) -> Tensor:
    """``[B]`` int64: the per-(sample, position) half of the counter, hashed once per row."""
    positions = torch.as_tensor(positions, dtype=torch.int64, device=keys.device)
    return mix64(keys ^ mix64(positions * _POSITION_SALT + _GOLDEN))


def uniform_noise_at(keys: Tensor, positions: Tensor | int, token_ids: Tensor) -> Tensor:
    """`uniform_noise` at the given token ids only: float64 ``[B, C]`` for ids ``[B, C]``.

    ``uniform_noise_at(k, t, ids) == uniform_noise(k, t, V).gather(1, ids)``, bit for bit.
    """
    row = row_seeds(keys, positions).reshape(-1, 1)
    bits = _shift_right(mix64(row + (token_ids + 1) * _GOLDEN), 11)  # top 53 bits
    return (bits.to(torch.float64) + 0.5) * _TWO_POW_M53


def process_logits(logits: Tensor, params: SamplingParams) -> Tensor:
    """Float32 logits of the sampling distribution: temperature, then top-k, then top-p.

    Removed tokens get ``-inf``. Greedy params return the raw logits (as float32). This
    is the reference definition (one full sort for top-p); `sample_tokens` does not call it.
    """
    scores = logits.float()
    if params.greedy:
        return scores
    scores = scores / params.temperature
    if 0 < params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:  # lower token ids first among equal scores
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True, stable=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before > params.top_p
        drop_sorted[..., 0] = False  # the most likely token always stays
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores


def reference_sample_tokens(
    logits: Tensor, keys: Tensor, positions: Tensor | int, params: SamplingParams
) -> tuple[Tensor, Tensor]:
    """The definition of a draw, computed over whole ``[B, vocab]`` float64 tensors.

    Slow (a full-vocabulary hash, float64 logs and, for top-p, a full sort per row); the
    yardstick `sample_tokens` is tested against.
    """
    scores = process_logits(logits, params)
    if params.greedy:
        tokens = scores.argmax(dim=-1)
    else:
        noise = uniform_noise(keys.to(scores.device), positions, scores.shape[-1])
        tokens = (noise.log_().neg_().log_().neg_() + scores).argmax(dim=-1)
    log_probs = torch.log_softmax(scores, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, log_probs


def sample_tokens(
    logits: Tensor, keys: Tensor, positions: Tensor | int, params: SamplingParams
) -> tuple[Tensor, Tensor]:
    """Draw one token per row; return ``(tokens [B] int64, log_probs [B] float32)``.

    The same tokens as `reference_sample_tokens`, computed cheaply (module docstring).

    Args:
        logits: ``[B, vocab]`` raw next-token logits.
        keys: ``[B]`` int64 sample keys (`sample_keys`), on any device.
        positions: decode position of each row (0 for the first response token).
        params: the sampling parameters.
    """
    scores = logits.float()
    if params.greedy:
        tokens = scores.argmax(dim=-1)
        return tokens, _log_prob_of(scores, tokens)
    scores = scores / params.temperature
    keys = keys.to(scores.device)
    positions = torch.as_tensor(positions, dtype=torch.int64, device=scores.device)
    positions = positions.expand(scores.shape[0]) if positions.dim() == 0 else positions
    candidates = _candidates(scores, params)
    if candidates is None:  # no filter: every token can win
        tokens = _gumbel_argmax_full(scores, keys, positions)
        return tokens, _log_prob_of(scores, tokens)
    ids, values = candidates  # [B, C]; removed candidates hold -inf
    gumbel = uniform_noise_at(keys, positions, ids).log_().neg_().log_().neg_()
    best = (gumbel + values).argmax(dim=-1, keepdim=True)
    log_probs = values.gather(-1, best) - torch.logsumexp(values, dim=-1, keepdim=True)
    return ids.gather(-1, best).squeeze(-1), log_probs.squeeze(-1)


def _log_prob_of(scores: Tensor, tokens: Tensor) -> Tensor:
    chosen = scores.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return chosen - torch.logsumexp(scores, dim=-1)


def _candidates(scores: Tensor, params: SamplingParams) -> tuple[Tensor, Tensor] | None:
    """Token ids and scores that top-k / top-p keep, most likely first (None: all of them).

    Scores of tokens inside the returned window that the filters remove are ``-inf``.
    Falls back to the reference masking (whole vocabulary) where ties at the k-th score
    make top-k keep more than k tokens, or where top-p keeps most of the vocabulary.
    """
    vocab = scores.shape[-1]
    top_k = params.top_k if 0 < params.top_k < vocab else 0
    if not top_k and params.top_p >= 1.0:
        return None
    if top_k:
        values, ids = torch.topk(scores, top_k + 1, dim=-1)
        if bool((values[:, top_k] == values[:, top_k - 1]).any()):
            return _masked_candidates(scores, params)
        values, ids = _canonical_order(values[:, :top_k], ids[:, :top_k])
        if params.top_p >= 1.0:
            return ids, values
        return ids, _top_p_mask(values, torch.softmax(values, dim=-1), params.top_p)
    probs_all = torch.softmax(scores, dim=-1)
    width = min(_TOP_P_FIRST_CANDIDATES, vocab)
    while True:
        values, ids = _canonical_order(*torch.topk(scores, width, dim=-1))
        probs = probs_all.gather(-1, ids)
        masked = _top_p_mask(values, probs, params.top_p)
        if width == vocab or _window_decides(values, masked):
            return ids, masked
        # Tokens past the window are no likelier than its last one: at least this many
        # more are needed to reach top_p.
        missing = max((params.top_p - probs.sum(dim=-1)).max().item(), 0.0)
        needed = width + missing / max(probs[:, -1].min().item(), 1e-30)
        if needed * 4 > vocab:
            return _masked_candidates(scores, params)
        width = min(vocab, max(2 * width, 1 << int(needed).bit_length()))


def _canonical_order(values: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    """Sort a window by score, most likely first, lower token id first among equal scores."""
    by_id = ids.argsort(dim=-1)
    values, ids = values.gather(-1, by_id), ids.gather(-1, by_id)
    by_value = values.argsort(dim=-1, descending=True, stable=True)
    return values.gather(-1, by_value), ids.gather(-1, by_value)


def _top_p_mask(values: Tensor, probs: Tensor, top_p: float) -> Tensor:
    """``values`` with -inf where the mass of the tokens before them exceeds ``top_p``."""
    if top_p >= 1.0:
        return values
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop = mass_before > top_p
    drop[:, 0] = False  # the most likely token always stays
    return values.masked_fill(drop, float("-inf"))


def _window_decides(values: Tensor, masked: Tensor) -> bool:
    """True when every row drops a token inside the window, and the tokens it keeps
    score strictly above the window's last one (no tie reaches past the window)."""
    kept = torch.isfinite(masked).sum(dim=-1)
    if bool((kept == values.shape[-1]).any()):
        return False
    last_kept = values.gather(-1, (kept - 1).unsqueeze(-1)).squeeze(-1)
    return bool((last_kept > values[:, -1]).all())


def _masked_candidates(scores: Tensor, params: SamplingParams) -> tuple[Tensor, Tensor]:
    """The reference filters over the whole vocabulary, as (all ids, masked scores)."""
    greedy_free = SamplingParams(temperature=1.0, top_p=params.top_p, top_k=params.top_k)
    masked = process_logits(scores, greedy_free)
    ids = torch.arange(scores.shape[-1], device=scores.device).expand_as(scores)
    return ids, masked


_TOKEN_COUNTERS: dict[tuple[int, str], Tensor] = {}


def _token_counters(vocab: int, device: torch.device) -> Tensor:
    """``(arange(vocab) + 1) * golden`` (int64), cached per vocabulary size and device."""
    key = (vocab, str(device))
    if key not in _TOKEN_COUNTERS:
        if len(_TOKEN_COUNTERS) > 8:
            _TOKEN_COUNTERS.clear()
        ids = torch.arange(1, vocab + 1, dtype=torch.int64, device=device)
        _TOKEN_COUNTERS[key] = ids.mul_(_GOLDEN)
    return _TOKEN_COUNTERS[key]


def _gumbel_argmax_full(scores: Tensor, keys: Tensor, positions: Tensor) -> Tensor:
    """argmax over the vocabulary of (scores + Gumbel noise), in chunks, in place.

    Each chunk of rows x tokens is hashed, turned into float64 Gumbel noise and reduced
    to its running best; earlier tokens win exact ties, as in a plain argmax.
    """
    n_rows, vocab = scores.shape
    seeds = row_seeds(keys, positions).reshape(-1, 1)
    counters = _token_counters(vocab, scores.device)
    chunk = _NOISE_CHUNK_ELEMENTS.get(scores.device.type, _NOISE_CHUNK_DEFAULT)
    rows_per = max(1, chunk // vocab)
    cols_per = min(vocab, max(1, chunk // rows_per))
    tokens = torch.empty(n_rows, dtype=torch.int64, device=scores.device)
    for r0 in range(0, n_rows, rows_per):
        rows = slice(r0, r0 + rows_per)
        best = torch.full_like(seeds[rows, 0], 0, dtype=torch.float64).fill_(float("-inf"))
        best_at = torch.zeros_like(seeds[rows, 0])
        for c0 in range(0, vocab, cols_per):
            x = seeds[rows] + counters[c0 : c0 + cols_per]
            x = _mix64_(x)
            x.bitwise_right_shift_(11).bitwise_and_((1 << 53) - 1)
            key = x.to(torch.float64).add_(0.5).mul_(_TWO_POW_M53)
            key.log_().neg_().log_().neg_().add_(scores[rows, c0 : c0 + cols_per])
            value, at = key.max(dim=-1)
            better = value > best
            best = torch.where(better, value, best)
            best_at = torch.where(better, at + c0, best_at)
        tokens[rows] = best_at
    return tokens


def _mix64_(x: Tensor) -> Tensor:
    """`mix64` in place on a tensor the caller owns."""
    x.bitwise_xor_(_shift_right(x, 30)).mul_(_MUL1)
    x.bitwise_xor_(_shift_right(x, 27)).mul_(_MUL2)
    return x.bitwise_xor_(_shift_right(x, 31))
