"""What the ranks of a sharded training engine agree on before they compute.

FSDP runs collectives in every forward and backward, so the ranks must make the same
number of model calls (`micro_batch_plan`: the most micro-batches any rank needs,
dummies where a rank has fewer), scale losses by the same global counts
(`global_counts`, each data-parallel group's rows counted once) and split into the same number of mini-batches
(`check_same_on_all_ranks`). Unsharded, each is the local value, with no collective.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from rayrl.batch import Batch
from rayrl.train.loss_contract import Peak
from rayrl.train.outputs import response_width
from rayrl.train.packing import plan_fixed, plan_shared_budget, plan_token_budget, split_to_count
from rayrl.train.shared_prompts import prompt_groups

Plan = list[list[int] | None]  # row indices per micro-batch; None: a dummy to keep ranks in step


def all_reduce(values: list[float], sharded: bool, device: Any, op: Any = None) -> list[float]:
    """`values` summed (or reduced by `op`) over the ranks; as they are when unsharded."""
    if not sharded:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op if op is not None else dist.ReduceOp.SUM)
    reduced: list[float] = tensor.tolist()
    return reduced


class LossMetrics:
    """A mini-batch's loss and loss_fn metrics, micro-batch by micro-batch, on the device:
    each share summed, each `Peak` the largest (`rayrl.train.loss_contract`)."""

    def __init__(self, device: Any) -> None:
        self.device = device
        zero = torch.zeros((), dtype=torch.float64, device=device)
        self.shares: dict[str, Tensor] = defaultdict(lambda: zero, loss=zero)
        self.peaks: dict[str, Tensor] = {}

    def add(self, loss: Tensor, metrics: dict[str, Any]) -> None:
        """One micro-batch's loss share and metrics."""
        self.shares["loss"] = self.shares["loss"] + loss.detach().double()
        for key, value in metrics.items():
            if isinstance(value, Peak):
                value = torch.as_tensor(value.value, dtype=torch.float64, device=self.device)
                held = self.peaks.get(key)
                top = value.detach().max()
                self.peaks[key] = top if held is None else torch.maximum(held, top)
                continue
            value = torch.as_tensor(value, dtype=torch.float64, device=self.device)
            self.shares[key] = self.shares[key] + value.detach().sum()

    def reduce(self, counted: bool, sharded: bool) -> dict[str, float]:
        """The totals over the ranks; a rank that is not ``counted`` (the same rows as
        another) adds nothing. Every rank ran the same loss_fn: the same keys."""
        keys = sorted(self.shares)
        local = torch.stack([self.shares[k] for k in keys]) * float(counted)
        totals = dict(zip(keys, all_reduce(local.tolist(), sharded, self.device), strict=True))
        if self.peaks:
            names = sorted(self.peaks)
            local_peaks = [float(self.peaks[k]) if counted else -math.inf for k in names]
            highest = all_reduce(local_peaks, sharded, self.device, op=dist.ReduceOp.MAX)
            totals.update(zip(names, highest, strict=True))
        return totals


def micro_batch_plan(
    batch: Batch,
    micro_batch_size: int | None,
    max_tokens: int | None,
    sharded: bool,
    device: Any,
    share_prompts: bool = False,
) -> Plan:
    """Micro-batches of row indices, the same number on every rank. ``share_prompts``:
    a token budget keeps the rows of a prompt together (`plan_shared_budget`)."""
    if "input_ids" not in batch or not ("responses" in batch or "response_mask" in batch):
        raise KeyError(
            f"the engine needs input_ids, attention_mask and responses (or response_mask) "
            f"columns; the batch has {batch.keys()}."
        )
    lengths = batch["attention_mask"].sum(dim=-1).tolist()
    if max_tokens and share_prompts:
        groups = prompt_groups(batch, response_width(batch))
        bins = plan_shared_budget(lengths, groups, max_tokens)
    elif max_tokens:
        bins = plan_token_budget(lengths, max_tokens)
    else:
        bins = plan_fixed(len(batch), micro_batch_size or len(batch))
    count = int(all_reduce([float(len(bins))], sharded, device, op=dist.ReduceOp.MAX)[0])
    bins = split_to_count(bins, lengths, count)
    return [*bins, *([None] * (count - len(bins)))]


def global_counts(
    mini: Batch, sharded: bool, device: Any, counted: bool = True
) -> tuple[float, float]:
    """Real response tokens and non-empty sequences of the mini-batch, all ranks.

    ``counted`` False: this rank's rows are another rank's too (the ranks of a
    sequence-parallel group hold the same rows; only the first of them counts).
    """
    if "response_mask" in mini:
        mask = mini["response_mask"]
    else:
        mask = mini["attention_mask"][:, -mini["responses"].shape[1] :]  # no response_mask
    per_seq = mask.to(torch.float64).sum(dim=-1)
    local = [float(per_seq.sum()), float((per_seq > 0).sum())] if counted else [0.0, 0.0]
    tokens, seqs = all_reduce(local, sharded, device)
    return tokens, seqs


def check_same_on_all_ranks(value: int, what: str, sharded: bool, device: Any) -> None:
    """ValueError unless every rank has the same `value`."""
    high, neg_low = all_reduce([float(value), -float(value)], sharded, device, op=dist.ReduceOp.MAX)
    if high != -neg_low:
        raise ValueError(
            f"the {what} differs between ranks ({int(-neg_low)} to {int(high)}); give "
            "every rank the same number of rows and the same mini_batch_size."
        )
