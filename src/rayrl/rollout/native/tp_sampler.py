"""Seeded sampling over a vocabulary split across tensor-parallel ranks.

Each rank holds the logits of its vocabulary rows ``[lo, hi)`` only. A draw is the one
`rayrl.rollout.sampling` defines over the whole vocabulary, made exactly:

- greedy and plain temperature sampling (no top-k, no top-p): each rank takes the best
  key of its rows (the score for greedy; score + Gumbel noise for sampling, the noise of
  token ``v`` hashed from its global id, so bit for bit the key the whole-vocabulary
  sampler computes for it), the lowest id among equal keys, and the logsumexp of its
  rows. One all-gather of ``[4, B]`` float64 per step (key, token, score, logsumexp)
  gives every rank the same winner: the best key, the lowest rank among equal keys,
  hence the lowest token id, as in a plain argmax. Its log-prob is its score minus
  the logsumexp of the ranks' logsumexps.
- top-k or top-p: their candidate sets depend on the whole vocabulary, so the logits
  shards are all-gathered (``[B, V]`` in the model dtype on every rank) and the
  whole-vocabulary sampler (`sample_tokens`) runs on them, the same on every rank.

Either way every rank of the group ends with the same tokens and log-probs, so each
runs the same scheduling step next (`rayrl.rollout.native.tp`). The noise is
hashed with torch operations (the fused Triton sampler serves one GPU only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from rayrl.rollout.native.sampler import DeviceSampler
from rayrl.rollout.native.tp import TensorParallel
from rayrl.rollout.sampling import SamplingParams, sample_tokens, uniform_noise_at

__all__ = ["SplitVocabSampler"]

# Rows x tokens hashed at a time: float64 and int64 temporaries of this many elements.
_CHUNK_ELEMENTS = {"cpu": 1 << 16}
_CHUNK_DEFAULT = 1 << 22


class SplitVocabSampler(DeviceSampler):
    """A `DeviceSampler` whose logits are this rank's vocabulary rows."""

    def __init__(self, tp: TensorParallel) -> None:
        super().__init__("torch")
        self.tp = tp
        self.lo, self.hi = tp.shard.vocab_rows
        self.vocab, self.width = tp.shard.spec.vocab, tp.shard.vocab_width

    def draw(
        self, logits: Tensor, keys: Tensor, positions: Tensor, params: SamplingParams
    ) -> Tensor:
        """float64 ``[2, B]``, the same on every rank: global token ids, then log-probs."""
        if params.greedy or (params.top_k <= 0 and params.top_p >= 1.0):
            return self._draw_split(logits, keys, positions, params)
        tokens, log_probs = sample_tokens(self.gather_logits(logits), keys, positions, params)
        return torch.stack([tokens.double(), log_probs.double()])

    def gather_logits(self, logits: Tensor) -> Tensor:
        """``[B, V]``: the whole vocabulary's logits from every rank's rows."""
        n = logits.shape[0]
        if logits.shape[1] < self.width:  # the last rank's rows, padded to the others'
            logits = F.pad(logits, (0, self.width - logits.shape[1]), value=float("-inf"))
        parts = self.tp.all_gather(logits)  # [size, B, width]
        return parts.permute(1, 0, 2).reshape(n, -1)[:, : self.vocab]

    def _draw_split(
        self, logits: Tensor, keys: Tensor, positions: Tensor, params: SamplingParams
    ) -> Tensor:
        scores = logits.float()
        if params.greedy:
            best, at = scores.max(dim=-1)
        else:
            scores = scores / params.temperature
            best, at = _gumbel_best(scores, keys.to(scores.device), positions, self.lo)
        chosen = scores.gather(-1, at.unsqueeze(-1)).squeeze(-1)
        mine = torch.stack(
            [best.double(), (at + self.lo).double(), chosen.double(), _logsumexp(scores)]
        )
        every = self.tp.all_gather(mine)  # [size, 4, B]
        winner = every[:, 0].argmax(dim=0, keepdim=True)  # the first rank among equal keys
        token = every[:, 1].gather(0, winner).squeeze(0)
        score = every[:, 2].gather(0, winner).squeeze(0)
        return torch.stack([token, score - torch.logsumexp(every[:, 3], dim=0)])


def _logsumexp(scores: Tensor) -> Tensor:
    return torch.logsumexp(scores, dim=-1).double()


def _gumbel_best(
    scores: Tensor, keys: Tensor, positions: Tensor, first_id: int
) -> tuple[Tensor, Tensor]:
    """Per row: the best float64 key ``score + Gumbel noise`` over the rows' tokens
    ``first_id + column``, and its column (the first among equal keys)."""
    n, width = scores.shape
    positions = torch.as_tensor(positions, dtype=torch.int64, device=scores.device)
    positions = positions.expand(n) if positions.dim() == 0 else positions
    ids = torch.arange(first_id, first_id + width, device=scores.device)
    chunk = _CHUNK_ELEMENTS.get(scores.device.type, _CHUNK_DEFAULT)
    rows_per = max(1, chunk // max(width, 1))
    best = torch.empty(n, dtype=torch.float64, device=scores.device)
    at = torch.empty(n, dtype=torch.int64, device=scores.device)
    for r0 in range(0, n, rows_per):
        rows = slice(r0, r0 + rows_per)
        count = min(n, r0 + rows_per) - r0
        noise = uniform_noise_at(keys[rows], positions[rows], ids.expand(count, -1))
        key = noise.log_().neg_().log_().neg_().add_(scores[rows])
        best[rows], at[rows] = key.max(dim=-1)
    return best, at
