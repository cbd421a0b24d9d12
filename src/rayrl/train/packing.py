"""Micro-batch planning and sequence packing for the training engine.

Two concerns of turning a rank's batch into model calls:

* **Planning** which rows go into which micro-batch: fixed-size chunks
  (`plan_fixed`), or token-budget bins (`plan_token_budget`, first-fit decreasing on
  real-token counts) that keep each micro-batch's real tokens within a budget.
  `split_to_count` then cuts bins until every rank has the same number of
  micro-batches (FSDP runs collectives in every forward and backward, so ranks must
  make the same number of model calls).
* **Packing** a micro-batch: pad tokens are dropped and the rows' real tokens are
  concatenated into one row whose position ids restart at 0 for every sequence. The
  attention is told where each sequence starts (`rayrl.train.attention`: varlen
  attention in place of ``sdpa``, never a dense block-diagonal mask), so sequences
  never attend to each other and no FLOP goes to padding. `ResponseIndex` records
  where each response token's logit sits in the model input, so results scatter back
  to ``[batch, response_len]``.
  Packing pays where padding is worth dropping (`worth_packing`): on a GPU (one varlen
  kernel) whenever there is any; on a CPU, where packed rows attend one sequence at a
  time, only when padding is a large share of the batch.

Layout (verl's): ``input_ids``, ``attention_mask``, ``position_ids`` are ``[b, P + R]``
with left-padded prompts and right-padded responses; the last ``R`` columns are the
response. The logit predicting the token in column ``c`` is read at column ``c - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "PackedInputs",
    "check_contiguous",
    "ResponseIndex",
    "pack_sequences",
    "padded_response_index",
    "plan_fixed",
    "plan_shared_budget",
    "plan_token_budget",
    "split_to_count",
    "worth_packing",
]

# On a CPU, packed rows attend one sequence at a time (`rayrl.train.attention`), which
# costs more than a little padding: rows pack only from a quarter of their tokens
# padding (measured on the demo's rows: docs/benchmarks.md).
CPU_MIN_PADDING_TO_PACK = 0.25


def worth_packing(attention_mask: Tensor, device: torch.device) -> bool:
    """Whether the rows of `attention_mask` run faster packed than padded on `device`."""
    padding: float = 1.0 - float(attention_mask.sum()) / max(attention_mask.numel(), 1)
    return padding >= (CPU_MIN_PADDING_TO_PACK if device.type == "cpu" else 0.0) and padding > 0


# ------------------------------------------------------------------------ planning
def plan_fixed(num_rows: int, micro_batch_size: int) -> list[list[int]]:
    """Consecutive chunks of ``micro_batch_size`` rows (the last may be smaller)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}.")
    return [
        list(range(start, min(start + micro_batch_size, num_rows)))
        for start in range(0, num_rows, micro_batch_size)
    ]


def plan_token_budget(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Group rows into bins of at most ``max_tokens`` real tokens (first-fit decreasing).

    Args:
        lengths: real-token count of each row (prompt + response, no padding).
        max_tokens: the budget per micro-batch.

    Returns:
        Bins of row indices, each sorted ascending; bins ordered by their first row.

    Raises:
        ValueError: a single row is longer than the budget.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens_per_micro_batch must be >= 1, got {max_tokens}.")
    longest = max(lengths, default=0)
    if longest > max_tokens:
        row = lengths.index(longest)
        raise ValueError(
            f"row {row} has {longest} real tokens, more than max_tokens_per_micro_batch="
            f"{max_tokens}; raise max_tokens_per_micro_batch to at least {longest} "
            "(usually max_prompt_length + max_response_length)."
        )
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for b, load in enumerate(loads):
            if load + lengths[i] <= max_tokens:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def plan_shared_budget(
    lengths: list[int], groups: list[tuple[list[int], int]], max_tokens: int
) -> list[list[int]]:
    """`plan_token_budget` for micro-batches whose rows share prompts
    (`rayrl.train.shared_prompts`): ``groups`` are ``(rows, prompt length)``, and the
    rows of a prompt go into one micro-batch (into as few as hold them where they
    exceed the budget together), so that they share it. Each row counts whole, as
    without sharing: the budget bounds a micro-batch's memory as the user set it (the
    output head's tokens do not shrink with shared prompts; counting each prompt once
    let 1.75x the response tokens into a micro-batch of the reference shape, and the
    update's peak memory reached 130.7 GiB on an H200)."""
    plan_token_budget(lengths, max_tokens)  # a row longer than the budget: its error
    chunks: list[tuple[list[int], int]] = []
    for rows, _prompt in groups:
        chunk: list[int] = []
        cost = 0
        for row in rows:
            if chunk and cost + lengths[row] > max_tokens:
                chunks.append((chunk, cost))
                chunk, cost = [], 0
            chunk.append(row)
            cost += lengths[row]
        chunks.append((chunk, cost))
    bins = plan_token_budget([cost for _, cost in chunks], max_tokens)
    return sorted(
        (sorted(row for c in b for row in chunks[c][0]) for b in bins), key=lambda b: b[0]
    )


def split_to_count(bins: list[list[int]], lengths: list[int], count: int) -> list[list[int]]:
    """Split the heaviest bins in two until there are ``count`` bins (or no bin splits).

    A split bin keeps its budget: each half holds a subset of its rows. The result
    has fewer than ``count`` bins only when every bin holds a single row; the caller
    then pads with dummy micro-batches.
    """
    bins = [list(b) for b in bins]
    while len(bins) < count:
        splittable = [b for b in bins if len(b) > 1]
        if not splittable:
            break
        heaviest = max(splittable, key=lambda b: sum(lengths[i] for i in b))
        bins.remove(heaviest)
        half = _balanced_halves(heaviest, lengths)
        bins.extend(half)
    return sorted(bins, key=lambda b: b[0])


def _balanced_halves(rows: list[int], lengths: list[int]) -> list[list[int]]:
    """Two non-empty groups of ``rows`` with close token sums (greedy, longest first)."""
    order = sorted(rows, key=lambda i: -lengths[i])
    halves: list[list[int]] = [[order[0]], [order[1]]]
    loads = [lengths[order[0]], lengths[order[1]]]
    for i in order[2:]:
        side = 0 if loads[0] <= loads[1] else 1
        halves[side].append(i)
        loads[side] += lengths[i]
    return [sorted(h) for h in halves]


# ------------------------------------------------------------------------- packing
@dataclass
class ResponseIndex:
    """Where the logits of a micro-batch's response tokens sit in the model output.

    Attributes:
        valid: ``[b, R]`` bool, True where a response token is real and has a
            predecessor (the first token of a sequence has no logit predicting it).
        logit_index: 1-D positions along the model's sequence dim, one per True in
            ``valid`` (row-major order) for packed inputs; ``[R]`` column indices
            shared by every row for padded inputs.
        labels: the tokens those logits predict, same layout as ``logit_index``'s
            selection (1-D packed, ``[b, R]`` padded).
    """

    valid: Tensor
    logit_index: Tensor
    labels: Tensor

    def scatter(self, values: Tensor, fill: float = 0.0) -> Tensor:
        """``[b, R]`` from packed per-token values (1-D, one per True in ``valid``)."""
        out = torch.full(self.valid.shape, fill, dtype=values.dtype, device=values.device)
        out[self.valid] = values
        return out


@dataclass
class PackedInputs:
    """One row holding a micro-batch's sequences back to back, pads removed."""

    input_ids: Tensor  # [1, total_real_tokens]
    position_ids: Tensor  # [1, total_real_tokens], restarting at 0 per sequence
    response: ResponseIndex


def _valid_response(attention_mask: Tensor, response_len: int) -> Tensor:
    """``[b, R]``: the response token is real and so is the token before it."""
    mask = attention_mask.bool()
    width = mask.shape[1]
    return mask[:, width - response_len :] & mask[:, width - response_len - 1 : width - 1]


def padded_response_index(
    input_ids: Tensor, attention_mask: Tensor, response_len: int
) -> ResponseIndex:
    """The `ResponseIndex` of a padded ``[b, P + R]`` micro-batch (no packing)."""
    width = input_ids.shape[1]
    if not 0 < response_len < width:
        raise ValueError(
            f"response length {response_len} must be in [1, {width - 1}] for inputs of "
            f"width {width}: at least one prompt column is needed before the response."
        )
    columns = torch.arange(width - response_len - 1, width - 1, device=input_ids.device)
    return ResponseIndex(
        valid=_valid_response(attention_mask, response_len),
        logit_index=columns,
        labels=input_ids[:, width - response_len :],
    )


def pack_sequences(
    input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, response_len: int
) -> PackedInputs:
    """Concatenate the real tokens of each row into one row with restarting positions.

    Each row's real tokens must be contiguous (left-padded prompt followed by a
    right-padded response) and its position ids must start at 0 at its first real
    token (verl's ``cumsum(attention_mask) - 1``): a sequence boundary is where the
    position id does not grow by one.
    """
    padded = padded_response_index(input_ids, attention_mask, response_len)
    mask = attention_mask.bool()
    check_contiguous(mask, position_ids)
    lengths = mask.sum(dim=1)
    starts = torch.cumsum(lengths, dim=0) - lengths
    packed_pos = starts.unsqueeze(1) + mask.long().cumsum(dim=1) - 1  # valid where mask
    width = input_ids.shape[1]
    before = packed_pos[:, width - response_len - 1 : width - 1]
    return PackedInputs(
        input_ids=input_ids[mask].unsqueeze(0),
        position_ids=position_ids[mask].unsqueeze(0),
        response=ResponseIndex(
            valid=padded.valid,
            logit_index=before[padded.valid],
            labels=padded.labels[padded.valid],
        ),
    )


def check_contiguous(mask: Tensor, position_ids: Tensor) -> None:
    """Raise when a row's real tokens have a hole or its positions do not start at 0."""
    lengths = mask.sum(dim=1)
    first = mask.long().argmax(dim=1)
    span = mask.shape[1] - mask.long().flip(1).argmax(dim=1) - first
    holes = (lengths > 0) & (span != lengths)
    if bool(holes.any()):
        row = int(holes.nonzero()[0, 0])
        raise ValueError(
            f"row {row}: attention_mask has padding between real tokens; packing needs "
            "left-padded prompts followed by right-padded responses. Set "
            "use_remove_padding=False for other layouts."
        )
    start_pos = position_ids.gather(1, first.unsqueeze(1)).squeeze(1)
    bad = (lengths > 0) & (start_pos != 0)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"row {row}: position_ids start at {int(start_pos[row])}, not 0, at the first "
            "real token; build them as (attention_mask.cumsum(-1) - 1).clamp(min=0)."
        )
