"""DAPO's dynamic sampling: keep only prompt groups whose rewards vary, until a batch is full.

A group whose responses all score the same (all right, all wrong) gives GRPO no signal.
With `algorithm.filter_groups.enable`, `fill_batch` drops such groups from the first
generation round and generates further rounds of fresh prompts until
`data.train_batch_size` groups are kept; the surplus of the last round is cut. Rounds
are bounded by `filter_groups.max_num_gen_batches` (<= 0: no bound); past the bound the
step fails with the numbers. The metric per sample is `score`, `seq_reward` (the sum
of its token scores) or the name of a reward extra (such as `acc`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from rayrl.algos import filter_groups
from rayrl.algos.routing import ROUTES, unrouted
from rayrl.batch import Batch
from rayrl.config.schema import RayRLConfig


class DynamicSamplingError(RuntimeError):
    """Too few prompt groups with varying rewards within the allowed generation rounds."""


def group_metric(batch: Batch, name: str) -> torch.Tensor:
    """The per-sample value groups are compared on."""
    if name == "score":
        return batch["scores"].double()
    if name == "seq_reward":
        return batch["token_level_scores"].double().sum(-1)
    extras = batch["reward_extra"] if "reward_extra" in batch else [{}] * len(batch)
    found = [e.get(name) if isinstance(e, dict) else None for e in extras]
    values = [v for v in found if v is not None]
    if len(values) < len(found):
        raise DynamicSamplingError(
            f"algorithm.filter_groups.metric={name!r}: the reward gives no {name!r} for "
            "some samples; use score or seq_reward, or return it from compute_score "
            "as a dict entry"
        )
    return torch.tensor([float(v) for v in values], dtype=torch.float64)


def _kept_groups(batch: Batch, metric: str) -> tuple[Batch, int, int]:
    result = filter_groups(batch["uid"], group_metric(batch, metric))
    rows = torch.nonzero(result.keep).squeeze(-1).tolist()
    return batch.index(rows), result.num_kept_groups, result.num_groups


def fill_batch(
    cfg: RayRLConfig, first: Batch, next_round: Callable[[int], Batch]
) -> tuple[Batch, dict[str, float]]:
    """Groups with varying rewards from `first` and, while too few, from
    `next_round(round)` (a generated and scored batch of fresh prompts, round >= 1).

    Returns exactly `data.train_batch_size` groups, whole, in the order they came, and
    the metrics `train/num_gen_batches` and `train/kept_group_ratio`.
    """
    fg, want = cfg.algorithm.filter_groups, cfg.data.train_batch_size
    if not fg.metric:  # refused by validation, but a config may be loaded without it
        raise DynamicSamplingError(
            "algorithm.filter_groups.enable=true needs algorithm.filter_groups.metric"
        )
    parts, kept, seen, rounds = [], 0, 0, 0
    batch = first
    while True:
        rounds += 1
        part, n_kept, n_groups = _kept_groups(batch, fg.metric)
        parts.append(part)
        kept, seen = kept + n_kept, seen + n_groups
        if kept >= want:
            break
        if 0 < fg.max_num_gen_batches <= rounds:
            raise DynamicSamplingError(
                f"dynamic sampling kept {kept} of {want} prompt groups after {rounds} "
                f"generation rounds ({seen} groups seen, the rest scored alike); raise "
                "algorithm.filter_groups.max_num_gen_batches, or check that the task is "
                "neither too easy nor too hard for the model"
            )
        batch = next_round(rounds)
    full = concat_left_padded(parts) if len(parts) > 1 else parts[0]
    full = full.index(_first_groups(full["uid"], want))
    metrics = {"train/num_gen_batches": float(rounds), "train/kept_group_ratio": kept / seen}
    return full, metrics


def _first_groups(uids: np.ndarray, count: int) -> list[int]:
    """Row indices of the first `count` groups (by first appearance), all their rows."""
    order: dict[str, None] = {}
    for uid in uids:
        order.setdefault(uid, None)
    chosen = set(list(order)[:count])
    return [i for i, uid in enumerate(uids) if uid in chosen]


def concat_left_padded(parts: list[Batch]) -> Batch:
    """Stack batches whose prompt-side columns have different widths (each round pads
    its prompts to its own longest): narrower columns get zeros on the left, where the
    attention mask is zero (a routing record gets `unrouted` there, its padding's mark).
    Columns kept by the workers are fetched first: their widths differ between rounds."""
    for part in parts:
        part.materialize()
    tensors = {}
    for key in parts[0].tensors:
        wide = parts[0].tensors[key].dim() > 1
        width = max(p.tensors[key].shape[1] for p in parts) if wide else 0
        tensors[key] = [_left_padded(key, p.tensors[key], width) for p in parts]
    padded = [
        Batch({k: v[i] for k, v in tensors.items()}, dict(p.non_tensors), dict(p.meta))
        for i, p in enumerate(parts)
    ]
    return Batch.concat(padded)


def _left_padded(key: str, column: torch.Tensor, width: int) -> torch.Tensor:
    """``column`` ``[rows, w, ...]`` padded on the left to ``width`` along its second dim."""
    if column.dim() < 2 or column.shape[1] >= width:
        return column
    fill = unrouted(column.dtype) if key == ROUTES else 0
    pad = column.new_full((column.shape[0], width - column.shape[1], *column.shape[2:]), fill)
    return torch.cat([pad, column], dim=1)
