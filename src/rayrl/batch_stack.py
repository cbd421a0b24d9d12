"""Stacking a column's parts from several batches (`Batch.concat`): the checks that
they can be stacked, and the copies, all at once or each part placed at its rows."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["cat_tensors", "check_stackable", "place_arrays", "place_tensors"]


def cat_tensors(key: str, parts: list[torch.Tensor]) -> torch.Tensor:
    check_stackable(key, parts)
    try:
        return torch.cat(parts, dim=0)
    except RuntimeError as err:  # e.g. parts on different devices
        raise ValueError(f"Batch.concat: cannot stack column {key!r}: {err}") from err


def check_stackable(key: str, parts: list[torch.Tensor]) -> None:
    dtypes = {p.dtype for p in parts}
    if len(dtypes) > 1:
        raise ValueError(
            f"Batch.concat: column {key!r} has mixed dtypes {sorted(map(str, dtypes))}."
        )
    shapes = [tuple(p.shape) for p in parts]
    if len({s[1:] for s in shapes}) > 1 or any(len(s) == 0 for s in shapes):
        raise ValueError(f"Batch.concat: cannot stack column {key!r} (shapes {shapes}).")


def place_tensors(key: str, spans: list, kept: int) -> torch.Tensor:
    parts = [b.tensors[key] for b, _, _ in spans]
    check_stackable(key, parts)
    out = torch.empty((kept, *parts[0].shape[1:]), dtype=parts[0].dtype, device=parts[0].device)
    for part, (_, n, where) in zip(parts, spans, strict=True):
        if n:
            out.index_copy_(0, where.to(out.device), part[:n])
    return out


def place_arrays(key: str, spans: list, kept: int) -> np.ndarray:
    parts = [b.non_tensors[key] for b, _, _ in spans]
    out = np.empty((kept, *parts[0].shape[1:]), dtype=np.result_type(*parts))
    for part, (_, n, where) in zip(parts, spans, strict=True):
        if n:
            out[where.numpy()] = part[:n]
    return out
