"""DAPO pieces (Yu et al. 2025): soft overlong penalty, truncation masking, group filtering.

- :func:`overlong_penalty`: a reward term that ramps from 0 to ``-penalty_factor`` as a
  response's length goes through the last ``buffer_length`` tokens before
  ``max_response_length`` (and stays there beyond it).
- :func:`find_truncated` / :func:`mask_truncated`: responses cut off at the length limit
  (no EOS) are dropped from the loss by clearing their response mask.
- :func:`filter_groups`: dynamic sampling; groups of responses to one prompt whose
  metric (score, accuracy) is the same for all of them carry no GRPO signal and are
  dropped. Single-response groups are kept, as in verl.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from rayrl.algos.groups import group_ids

__all__ = [
    "GroupFilter",
    "filter_groups",
    "find_truncated",
    "mask_truncated",
    "overlong_penalty",
]


def overlong_penalty(
    response_lengths: Tensor,
    max_response_length: int,
    buffer_length: int,
    penalty_factor: float = 1.0,
) -> Tensor:
    """Soft overlong penalty ``[batch]`` (<= 0) to add to each response's score.

    With ``L = max_response_length`` and ``B = buffer_length``::

        0                                    if length <= L - B
        (L - B - length) / B * penalty       if L - B < length <= L
        -penalty                             if length > L
    """
    if not 0 < buffer_length <= max_response_length:
        raise ValueError(
            f"overlong buffer_length must be in (0, max_response_length="
            f"{max_response_length}], got {buffer_length}"
        )
    lengths = response_lengths.to(torch.float64)
    excess = (lengths - (max_response_length - buffer_length)).clamp(min=0, max=buffer_length)
    penalty = -excess / buffer_length * penalty_factor
    return penalty.to(torch.get_default_dtype())


def find_truncated(
    response_ids: Tensor, response_mask: Tensor, eos_token_ids: int | Sequence[int]
) -> Tensor:
    """Bool ``[batch]``: responses whose last real token is not an EOS token.

    A response with no real token counts as truncated.
    """
    mask = response_mask.bool()
    eos = torch.as_tensor(
        [eos_token_ids] if isinstance(eos_token_ids, int) else list(eos_token_ids),
        device=response_ids.device,
    )
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, -1).amax(dim=-1)
    last_token = response_ids.gather(-1, last.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    ended = torch.isin(last_token, eos) & (last >= 0)
    return ~ended


def mask_truncated(response_mask: Tensor, truncated: Tensor) -> Tensor:
    """``response_mask`` with the rows of truncated responses cleared (same dtype)."""
    keep = (~truncated.bool()).unsqueeze(-1)
    return torch.where(keep, response_mask, torch.zeros_like(response_mask))


class GroupFilter(NamedTuple):
    """Result of :func:`filter_groups`.

    Attributes:
        keep: bool ``[batch]``, True for responses in kept groups.
        num_kept_groups: how many groups were kept.
        num_groups: how many groups there were.
    """

    keep: Tensor
    num_kept_groups: int
    num_groups: int


def filter_groups(index: Any, metric: Tensor, tolerance: float = 0.0) -> GroupFilter:
    """Keep prompt groups whose ``metric`` ``[batch]`` varies (max - min > tolerance).

    Groups with a single response are kept (no variance can be measured).
    """
    metric = metric.to(torch.float64)
    ids, num_groups = group_ids(index, device=metric.device)
    if ids.shape[0] != metric.shape[0]:
        raise ValueError(f"group index has {ids.shape[0]} entries but metric has {metric.shape[0]}")
    high = torch.full((num_groups,), -torch.inf, dtype=metric.dtype, device=metric.device)
    low = torch.full((num_groups,), torch.inf, dtype=metric.dtype, device=metric.device)
    high = high.scatter_reduce(0, ids, metric, reduce="amax")
    low = low.scatter_reduce(0, ids, metric, reduce="amin")
    size = torch.zeros(num_groups, dtype=torch.long, device=metric.device)
    size = size.index_add(0, ids, torch.ones_like(ids))
    kept = (high - low > tolerance) | (size == 1)
    return GroupFilter(
        keep=kept[ids], num_kept_groups=int(kept.sum().item()), num_groups=num_groups
    )
