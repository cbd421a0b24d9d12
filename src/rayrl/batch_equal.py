"""Equality of Batch columns and meta values: what `Batch.union` and `Batch.equals` use.

Tensors and arrays compare by shape, dtype and value with NaN equal to NaN; object
cells and meta values compare deeply (tensors, arrays, mappings, sequences).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


def tensors_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and values (NaN equals NaN), across devices."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a is b:
        return True
    b = b.to(a.device)
    if torch.equal(a, b):
        return True
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return False


def arrays_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Same shape and values; object cells compared deeply."""
    if a.shape != b.shape:
        return False
    if a is b:
        return True
    if a.dtype == object or b.dtype == object:
        return all(values_equal(x, y) for x, y in zip(a.flat, b.flat, strict=True))
    nan_ok = a.dtype.kind in "fc" and b.dtype.kind in "fc"
    return bool(np.array_equal(a, b, equal_nan=nan_ok))


def values_equal(a: Any, b: Any) -> bool:
    """Deep equality for meta values and object cells (tensors, arrays, containers)."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        both = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        return both and tensors_equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        both = isinstance(a, np.ndarray) and isinstance(b, np.ndarray)
        return both and arrays_equal(a, b)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(values_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(values_equal(x, y) for x, y in zip(a, b, strict=True))
        )
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True  # NaN
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return False
