"""Prompt groups: responses sampled from the same prompt share a group id (``index``).

GRPO, RLOO, REINFORCE++-baseline and DAPO's group filter all compare a response with
the other responses to its prompt. ``index`` is whatever identifies the prompt: a numpy
array of uid strings (verl's ``uid`` column), a list, or an integer tensor. This module
turns it into dense group numbers and computes per-group statistics without Python
loops over the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = ["GroupStats", "group_ids", "group_stats"]


def group_ids(index: Any, device: torch.device | str | None = None) -> tuple[Tensor, int]:
    """Dense group numbers ``[batch]`` in 0..G-1 (sorted order of the ids), and G.

    Args:
        index: group identifiers, one per sample: numpy array (any dtype, including
            object/str), list/tuple, or an integer tensor.
        device: where to put the returned tensor.
    """
    if isinstance(index, Tensor):
        if index.dim() != 1:
            raise ValueError(f"group index must be 1-D, got shape {tuple(index.shape)}")
        _, inverse = torch.unique(index, return_inverse=True)
        ids = inverse.to(device=device if device is not None else index.device)
    else:
        array = np.asarray(index)
        if array.ndim != 1:
            raise ValueError(f"group index must be 1-D, got shape {array.shape}")
        if array.dtype == object:
            array = array.astype(str)
        _, inverse = np.unique(array, return_inverse=True)
        ids = torch.as_tensor(inverse.reshape(-1), dtype=torch.long, device=device)
    num_groups = int(ids.max().item()) + 1 if ids.numel() else 0
    return ids, num_groups


@dataclass(frozen=True)
class GroupStats:
    """Each sample's view of its group, all ``[batch]`` in the scores' dtype.

    Attributes:
        size: number of samples in the sample's group.
        mean: group mean of the scores.
        std: group standard deviation with Bessel's correction (0 for singletons).
        total: group sum of the scores.
    """

    size: Tensor
    mean: Tensor
    std: Tensor
    total: Tensor


def group_stats(scores: Tensor, index: Any) -> GroupStats:
    """Group size, mean, std and sum of ``scores`` ``[batch]``, gathered back per sample.

    The sums run in float64 whatever the scores' dtype: squared deviations of float32
    scores overflow from about 1e19 on (a reward of 1e30 made every std infinite and
    every GRPO advantage 0), and float64 keeps them exact far beyond any sane reward.
    """
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D [batch], got shape {tuple(scores.shape)}")
    ids, num_groups = group_ids(index, device=scores.device)
    if ids.shape[0] != scores.shape[0]:
        raise ValueError(
            f"group index has {ids.shape[0]} entries but there are {scores.shape[0]} scores;"
            " pass one prompt uid per response"
        )
    wide = scores.double() if scores.is_floating_point() else scores
    zeros = torch.zeros(num_groups, dtype=wide.dtype, device=scores.device)
    counts = zeros.index_add(0, ids, torch.ones_like(wide))
    sums = zeros.index_add(0, ids, wide)
    means = sums / counts
    squares = zeros.index_add(0, ids, (wide - means[ids]) ** 2)
    var = torch.where(counts > 1, squares / (counts - 1).clamp(min=1), torch.zeros_like(counts))
    dtype = scores.dtype
    return GroupStats(
        size=counts[ids].to(dtype),
        mean=means[ids].to(dtype),
        std=var.sqrt()[ids].to(dtype),
        total=sums[ids].to(dtype),
    )
