"""Loss aggregation: from a per-token loss matrix to one scalar, independent of splitting.

Four modes, named as in verl (``actor_rollout_ref.actor.loss_agg_mode``):

==========================  ==============================================================
``token-mean``              sum over all real tokens / number of real tokens
``seq-mean-token-sum``      mean over sequences of each sequence's token sum
``seq-mean-token-mean``     mean over sequences of each sequence's token mean
``seq-mean-token-sum-norm`` mean over sequences of token sum / ``norm_length`` (Dr.GRPO)
==========================  ==============================================================

**Split invariance (the trainer relies on this).** A mini-batch is cut into
micro-batches (gradient accumulation) and spread over data-parallel ranks. Each mode is
a *sum* of per-token or per-sequence terms divided by a *mini-batch* count, so:

1. Before the mini-batch's first micro-batch, count its real tokens and its non-empty
   sequences (:func:`rayrl.algos.masked.token_and_seq_counts` on each micro-batch, then
   summed over micro-batches and all-reduced over DP ranks). Those are
   ``global_token_count`` and ``global_seq_count``.
2. Each micro-batch's loss is ``sum of its terms / global count``. Call ``backward()``
   on each micro-batch loss as it is: do **not** divide by the number of micro-batches.
   The micro-batch losses (and gradients) add up to the mini-batch loss (gradient).
3. Across DP ranks the gradients must be **summed**. DDP and FSDP *average* them
   (divide by the world size), so multiply each micro-batch loss by the DP world size
   before ``backward()`` (or turn the averaging off).

The result is the same loss and gradient however the mini-batch is split, including
uneven splits with different padded lengths. Without global counts the local counts are
used, which gives the usual per-micro-batch mean (correct for a single micro-batch).

A sequence with no real token contributes nothing and is not counted. For
``seq-mean-token-sum-norm`` pass ``norm_length`` (typically
``data.max_response_length``); it defaults to the padded length of the tensor, which
varies between micro-batches padded to their own longest response and then breaks
split invariance. Unlike verl's version, this mode divides by the number of sequences
too, so its scale does not grow with the batch size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

import torch
from torch import Tensor

from rayrl.registry import Registry

__all__ = ["AGG_MODES", "LossAggregation", "aggregate_loss", "aggregate_rows"]

Count: TypeAlias = int | float | Tensor
# A mode maps (loss_mat, mask, norm_length) to (sum of its terms, unit of the divisor).
AggFn = Callable[[Tensor, Tensor, float], tuple[Tensor, str]]
AGG_MODES: Registry[AggFn] = Registry(
    "loss aggregation mode", config_key="actor_rollout_ref.actor.loss_agg_mode"
)


def _token_sums(loss_mat: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Per-sequence token sums of the loss and real-token counts."""
    keep = mask.bool()
    weight = mask.to(loss_mat.dtype)
    selected = torch.where(keep, loss_mat, torch.zeros_like(loss_mat)) * weight
    return selected.sum(dim=-1), weight.sum(dim=-1)


@AGG_MODES.register("token-mean")
def _token_mean(loss_mat: Tensor, mask: Tensor, norm_length: float) -> tuple[Tensor, str]:
    sums, _ = _token_sums(loss_mat, mask)
    return sums.sum(), "token"


@AGG_MODES.register("seq-mean-token-sum")
def _seq_mean_token_sum(loss_mat: Tensor, mask: Tensor, norm_length: float) -> tuple[Tensor, str]:
    sums, _ = _token_sums(loss_mat, mask)
    return sums.sum(), "seq"


@AGG_MODES.register("seq-mean-token-mean")
def _seq_mean_token_mean(loss_mat: Tensor, mask: Tensor, norm_length: float) -> tuple[Tensor, str]:
    sums, counts = _token_sums(loss_mat, mask)
    return (sums / counts.clamp(min=1e-8)).sum(), "seq"


@AGG_MODES.register("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(
    loss_mat: Tensor, mask: Tensor, norm_length: float
) -> tuple[Tensor, str]:
    sums, _ = _token_sums(loss_mat, mask)
    return sums.sum() / norm_length, "seq"


def _local_count(mask: Tensor, unit: str) -> Tensor:
    per_seq = mask.to(torch.float64).sum(dim=-1)
    return per_seq.sum() if unit == "token" else (per_seq > 0).sum().to(torch.float64)


def aggregate_loss(
    loss_mat: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    global_token_count: Count | None = None,
    global_seq_count: Count | None = None,
    norm_length: float | None = None,
) -> Tensor:
    """Aggregate a ``[batch, response_len]`` loss matrix into this micro-batch's share.

    Args:
        loss_mat: per-token losses; padded positions may hold anything.
        response_mask: 1 for real tokens.
        loss_agg_mode: one of :data:`AGG_MODES`.
        global_token_count: real tokens in the whole mini-batch (all micro-batches, all
            DP ranks); used by ``token-mean``. Defaults to this micro-batch's count.
        global_seq_count: non-empty sequences in the whole mini-batch; used by the
            ``seq-mean-*`` modes. Defaults to this micro-batch's count.
        norm_length: the constant divisor of ``seq-mean-token-sum-norm``.

    Returns:
        A scalar; summing it over the micro-batches (and ranks) of a mini-batch gives
        the mini-batch loss. Zero when the divisor is zero.
    """
    if loss_mat.shape != response_mask.shape:
        raise ValueError(
            f"loss matrix {tuple(loss_mat.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must have the same [batch, response_len] shape"
        )
    mode = AGG_MODES.get(loss_agg_mode)
    length = float(norm_length) if norm_length is not None else float(loss_mat.shape[-1])
    total, unit = mode(loss_mat, response_mask, length)
    given = global_token_count if unit == "token" else global_seq_count
    if given is None:
        count = _local_count(response_mask, unit)
    else:
        count = torch.as_tensor(given, dtype=torch.float64)
    count = count.to(device=total.device, dtype=total.dtype)
    return total / count.clamp(min=1)


def aggregate_rows(
    sums: Tensor, counts: Tensor, loss_agg_mode: str = "token-mean", *, norm_length: float
) -> Tensor:
    """`aggregate_loss` of a whole batch from each row's sum over its real tokens and
    their count (what a worker holding the tokens sends instead of them): equal to it
    up to rounding. Each row stands as one position holding its token mean, weighted
    by its count, which every mode reduces to the same sums and counts."""
    counts = counts.to(torch.float64)
    means = sums.to(torch.float64) / counts.clamp(min=1)
    return aggregate_loss(
        means.unsqueeze(-1), counts.unsqueeze(-1), loss_agg_mode, norm_length=norm_length
    )


@dataclass(frozen=True)
class LossAggregation:
    """An aggregation mode bound to a mini-batch's counts, callable on a loss matrix.

    Build one per mini-batch and hand it to every loss of every micro-batch::

        agg = LossAggregation("token-mean", global_token_count=n_tok, global_seq_count=n_seq)
        loss, metrics = ppo_policy_loss(..., agg=agg)
    """

    mode: str = "token-mean"
    global_token_count: Count | None = None
    global_seq_count: Count | None = None
    norm_length: float | None = None

    def __post_init__(self) -> None:
        AGG_MODES.canonical(self.mode)  # fail at construction, naming the valid modes

    def __call__(self, loss_mat: Tensor, response_mask: Tensor) -> Tensor:
        """This micro-batch's share of the mini-batch loss."""
        return aggregate_loss(
            loss_mat,
            response_mask,
            self.mode,
            global_token_count=self.global_token_count,
            global_seq_count=self.global_seq_count,
            norm_length=self.norm_length,
        )
