"""Batch: the unit of data that moves between the controller and the workers.

A Batch holds tensor columns that share one leading batch dimension, non-tensor
columns (numpy arrays, usually 1-D object arrays of strings or nested Python values)
of the same length, and a `meta` dict that describes the rows (the step they belong
to, their epoch and position; inside the training engine, a micro-batch's global
token counts). Options of a call travel beside the Batch, never in `meta`
(`rayrl.workers.context.StepContext`).
Row operations (slicing, gathering, chunking, padding, repeating) act on every
column at once and return views where that is cheap.

Pickling is built for Ray's object store (see `rayrl.batch_codec`): each tensor
travels as one contiguous out-of-band byte buffer (an integer one in the narrowest
integer type that holds its values, widened back on arrival), a slice ships only its
own rows, a column of strings travels as one UTF-8 buffer and its offsets. Tensors
always arrive on CPU; out of Ray's object store they are views of its shared,
read-only memory (no copy, as numpy arrays from `ray.get` are; a narrowed one is a
private copy): do not write them in place; `writable()` copies them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import numpy as np
import torch

from rayrl.batch_codec import decode_objects, decode_tensor, encode_objects, encode_tensor
from rayrl.batch_equal import arrays_equal, tensors_equal, values_equal
from rayrl.batch_remote import (
    Remote,
    RowSource,
    concat_remote,
    fetch_columns,
    fetch_shared_remote,
    take_rows,
)
from rayrl.batch_stack import cat_tensors, place_arrays, place_tensors

_NUMERIC_KINDS = "biufc"  # numpy dtype kinds that become tensor columns
_STATE_VERSION = 4  # 2: string columns as UTF-8 buffers; 3: narrowed integers; 4: remote

__all__ = ["Batch"]


class Batch:
    """Tensor and non-tensor columns sharing one leading batch dimension, plus meta.

    Attributes:
        tensors: column name -> tensor whose first dimension is the batch.
        non_tensors: column name -> numpy array (usually 1-D, dtype object).
        meta: values that describe the whole batch, not one row.
        remote: column name -> the `RowSource` of a column whose rows stay where a
            worker stored them (`rayrl.batch_remote`); reading one fetches it.
    """

    __slots__ = ("tensors", "non_tensors", "meta", "remote")

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor] | None = None,
        non_tensors: Mapping[str, Any] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.non_tensors: dict[str, np.ndarray] = {}
        self.meta: dict[str, Any] = dict(meta or {})
        self.remote: Remote = {}
        for key, value in (tensors or {}).items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"Batch tensor column {key!r} is a {type(value).__name__}, not a "
                    "torch.Tensor; pass it in non_tensors or use Batch.from_dict."
                )
            self.tensors[key] = _checked_tensor(key, value)
        for key, value in (non_tensors or {}).items():
            if key in self.tensors:
                raise ValueError(
                    f"Batch column {key!r} is given both as a tensor and as a non-tensor; "
                    "keep one of them."
                )
            self.non_tensors[key] = _to_non_tensor(key, value)
        _check_lengths(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], meta: dict | None = None) -> Batch:
        """Build a Batch, sorting each value into a tensor or a non-tensor column.

        torch.Tensor and numeric numpy arrays become tensor columns (numpy memory is
        shared); lists, tuples, string arrays and object arrays become 1-D object
        columns, built element-wise so that a list of lists stays a column of lists.
        """
        tensors: dict[str, torch.Tensor] = {}
        non_tensors: dict[str, np.ndarray] = {}
        for key, value in data.items():
            column = _to_column(key, value)
            if isinstance(column, torch.Tensor):
                tensors[key] = column
            else:
                non_tensors[key] = column
        return cls(tensors, non_tensors, meta)

    # ----------------------------------------------------------------- mapping
    def __len__(self) -> int:
        for value in self.tensors.values():
            return int(value.shape[0])
        for value in self.non_tensors.values():
            return int(value.shape[0])
        for source in self.remote.values():
            return len(source)
        return 0

    def keys(self) -> list[str]:
        """Column names: tensor columns first, then non-tensor columns, then remote ones."""
        return [*self.tensors, *self.non_tensors, *self.remote]

    def __contains__(self, key: object) -> bool:
        return key in self.tensors or key in self.non_tensors or key in self.remote

    def get(self, key: str, default: Any = None) -> Any:
        """Column `key` (fetched when remote), or `default` when there is none."""
        return self._column(key) if key in self else default

    def materialize(self, keys: Sequence[str] | None = None) -> Batch:
        """Fetch remote columns `keys` (default: all) into ordinary ones, in place;
        returns the Batch itself."""
        wanted = list(self.remote) if keys is None else [k for k in keys if k in self.remote]
        if wanted:
            for key, column in fetch_columns(self.remote, wanted).items():
                self.remote.pop(key)
                target = self.tensors if isinstance(column, torch.Tensor) else self.non_tensors
                target[key] = column
        return self

    def __iter__(self) -> NoReturn:
        raise TypeError(
            "a Batch is not iterable; loop over batch.keys() for columns or "
            "batch.split(1) for rows."
        )

    def __getitem__(self, key: Any) -> Any:
        """A column for a str key; otherwise a Batch of the selected rows.

        Rows may be picked by int, slice, list of ints, int or bool numpy array, or
        Long/Bool tensor. Ints and step-1 or positive-step slices give views.
        """
        if isinstance(key, str):
            return self._column(key)
        if isinstance(key, (bool, np.bool_)):
            raise TypeError("a Batch cannot be indexed by a bool; use a boolean mask.")
        if isinstance(key, (int, np.integer)):
            length = len(self)
            i = int(key)
            if not -length <= i < length:
                raise IndexError(f"row {i} is out of range for a Batch of {length} rows.")
            i %= length
            return self._slice(slice(i, i + 1))
        if isinstance(key, slice):
            return self._slice(key)
        return self.index(key)

    def __setitem__(self, key: str, value: Any) -> None:
        """Add or replace a column; the value is sorted as in `from_dict`."""
        if not isinstance(key, str):
            raise TypeError(f"column names are str, got {type(key).__name__}.")
        column = _to_column(key, value)
        others = [k for k in self.keys() if k != key]
        if others and column.shape[0] != len(self):
            raise ValueError(
                f"Batch column {key!r} has {column.shape[0]} rows but column "
                f"{others[0]!r} has {len(self)} rows; every column must share the "
                "leading batch dimension."
            )
        self.tensors.pop(key, None)
        self.non_tensors.pop(key, None)
        self.remote.pop(key, None)
        if isinstance(column, torch.Tensor):
            self.tensors[key] = column
        else:
            self.non_tensors[key] = column

    def _column(self, key: str) -> Any:
        if key in self.remote:
            self.materialize([key])
        if key in self.tensors:
            return self.tensors[key]
        if key in self.non_tensors:
            return self.non_tensors[key]
        raise KeyError(f"Batch has no column {key!r}; its columns are {self.keys()}.")

    # -------------------------------------------------------------------- rows
    def _slice(self, s: slice) -> Batch:
        start, stop, step = s.indices(len(self))
        if step < 0:
            return self.index(list(range(start, stop, step)))
        tensors = {k: v[start:stop:step] for k, v in self.tensors.items()}
        non_tensors = {k: v[start:stop:step] for k, v in self.non_tensors.items()}
        remote = take_rows(self.remote, torch.arange(start, stop, step)) if self.remote else {}
        return _make(tensors, non_tensors, dict(self.meta), remote)

    def index(self, indices: Any) -> Batch:
        """Gather rows (reorder, repeat, select) into a new Batch; data is copied.

        `indices` is a sequence of ints (negative ones count from the end), an int
        numpy array or tensor, or a boolean mask as long as the Batch.
        """
        idx = _row_indices(indices, len(self))
        tensors = {k: v.index_select(0, idx.to(v.device)) for k, v in self.tensors.items()}
        idx_np = idx.numpy()
        non_tensors = {k: v[idx_np] for k, v in self.non_tensors.items()}
        return _make(tensors, non_tensors, dict(self.meta), take_rows(self.remote, idx))

    def select(self, *keys: str) -> Batch:
        """A Batch of the named columns, sharing their storage; meta is copied (shallow)."""
        names = _flatten_keys(keys)
        missing = [k for k in names if k not in self]
        if missing:
            raise KeyError(f"Batch.select: no column(s) {missing}; columns are {self.keys()}.")
        tensors = {k: self.tensors[k] for k in names if k in self.tensors}
        non_tensors = {k: self.non_tensors[k] for k in names if k in self.non_tensors}
        remote = {k: self.remote[k] for k in names if k in self.remote}
        return _make(tensors, non_tensors, dict(self.meta), remote)

    def pop(self, *keys: str) -> Batch:
        """Remove the named columns from this Batch and return them as a new Batch."""
        popped = self.select(*keys)
        for key in [*popped.tensors, *popped.non_tensors, *popped.remote]:
            self.tensors.pop(key, None)
            self.non_tensors.pop(key, None)
            self.remote.pop(key, None)
        return popped

    def union(self, other: Batch) -> Batch:
        """A new Batch with the columns and meta of both.

        A column present in both must hold equal values, the lengths must match
        (unless one side has no columns), and meta keys present in both must agree.
        """
        if self.keys() and other.keys() and len(self) != len(other):
            raise ValueError(
                f"Batch.union: lengths differ ({len(self)} rows vs {len(other)} rows)."
            )
        fetch_shared_remote(self, other)
        tensors, non_tensors = dict(self.tensors), dict(self.non_tensors)
        for key, value in other.tensors.items():
            if key in non_tensors:
                raise ValueError(f"Batch.union: column {key!r} is a tensor on one side only.")
            if key in tensors and not tensors_equal(tensors[key], value):
                raise ValueError(f"Batch.union: column {key!r} differs between the batches.")
            tensors[key] = value
        for key, value in other.non_tensors.items():
            if key in tensors:
                raise ValueError(f"Batch.union: column {key!r} is a tensor on one side only.")
            if key in non_tensors and not arrays_equal(non_tensors[key], value):
                raise ValueError(f"Batch.union: column {key!r} differs between the batches.")
            non_tensors[key] = value
        meta = dict(self.meta)
        for key, value in other.meta.items():
            if key in meta and not values_equal(meta[key], value):
                raise ValueError(
                    f"Batch.union: meta {key!r} conflicts ({meta[key]!r} vs {value!r})."
                )
            meta[key] = value
        remote = {**other.remote, **self.remote}
        return _make(tensors, non_tensors, meta, remote)

    @staticmethod
    def concat(batches: Sequence[Batch], rows: Sequence[int] | None = None) -> Batch:
        """Stack batches with the same columns row-wise; meta comes from the first.

        `rows` keeps the stack's rows in that order: a permutation of its first
        ``len(rows)`` rows (the others, say padding at the end, are dropped), placed in
        the stacking's one copy, where stacking and then `index` would copy twice.
        """
        batches = list(batches)
        if not batches:
            raise ValueError("Batch.concat needs at least one Batch.")
        if len({tuple(sorted(b.remote)) for b in batches}) > 1:
            for b in batches:  # remote in some, local in others: all local
                b.materialize()
        first = batches[0]
        for i, b in enumerate(batches[1:], start=1):
            _check_same_columns(first, b, i)
        if rows is not None:
            return _concat_rows(batches, rows)
        tensors = {k: cat_tensors(k, [b.tensors[k] for b in batches]) for k in first.tensors}
        non_tensors = {
            k: np.concatenate([b.non_tensors[k] for b in batches]) for k in first.non_tensors
        }
        remote = concat_remote([b.remote for b in batches])
        return _make(tensors, non_tensors, dict(first.meta), remote)

    def chunk(self, n: int) -> list[Batch]:
        """Exactly `n` views whose sizes differ by at most 1, larger ones first."""
        if n < 1:
            raise ValueError(f"Batch.chunk: n must be >= 1, got {n}.")
        q, r = divmod(len(self), n)
        parts, start = [], 0
        for i in range(n):
            stop = start + q + (1 if i < r else 0)
            parts.append(self._slice(slice(start, stop)))
            start = stop
        return parts

    def split(self, size: int) -> list[Batch]:
        """Views of `size` rows each, the last one possibly smaller; [] when empty."""
        if size < 1:
            raise ValueError(f"Batch.split: size must be >= 1, got {size}.")
        return [self._slice(slice(i, i + size)) for i in range(0, len(self), size)]

    def pad_to_multiple(self, n: int) -> tuple[Batch, int]:
        """Append copies of rows 0, 1, 2, ... (cycling) until len is a multiple of n.

        Returns (padded, pad_count); with nothing to pad it returns (self, 0).
        """
        if n < 1:
            raise ValueError(f"Batch.pad_to_multiple: n must be >= 1, got {n}.")
        length = len(self)
        pad = -length % n
        if pad == 0:
            return self, 0
        idx = torch.cat([torch.arange(length), torch.arange(pad) % length])
        return self.index(idx), pad

    def unpad(self, pad: int) -> Batch:
        """Drop the last `pad` rows (a view); the inverse of `pad_to_multiple`."""
        length = len(self)
        if not 0 <= pad <= length:
            raise ValueError(f"Batch.unpad: pad must be in [0, {length}], got {pad}.")
        return self if pad == 0 else self._slice(slice(0, length - pad))

    def repeat(self, n: int, interleave: bool = True) -> Batch:
        """Each row `n` times: interleaved (a a b b) or blocked (a b a b)."""
        if n < 1:
            raise ValueError(f"Batch.repeat: n must be >= 1, got {n}.")
        rows = torch.arange(len(self))
        return self.index(rows.repeat_interleave(n) if interleave else rows.repeat(n))

    # ------------------------------------------------------------------- misc
    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """A Batch with every tensor on `device`; non-tensor columns are shared.

        With ``non_blocking`` to a CUDA device, host tensors are first copied to
        page-locked memory, so the host does not wait for the device's queued work (a
        copy from pageable memory does)."""
        pin = non_blocking and torch.device(device).type == "cuda"
        tensors = {
            k: (v.pin_memory() if pin and v.device.type == "cpu" else v).to(
                device, non_blocking=non_blocking
            )
            for k, v in self.tensors.items()
        }
        return _make(tensors, dict(self.non_tensors), dict(self.meta), dict(self.remote))

    def writable(self) -> Batch:
        """A copy with private tensors and arrays, safe to write in place (those read from
        Ray's object store share its read-only memory)."""
        return _make(
            {k: v.clone() for k, v in self.tensors.items()},
            {k: v.copy() for k, v in self.non_tensors.items()},
            dict(self.meta),
            dict(self.remote),
        )

    def equals(self, other: object) -> bool:
        """True when both have the same columns, equal values (NaN equals NaN) and meta."""
        if not isinstance(other, Batch):
            return False
        self.materialize()
        other.materialize()
        if set(self.tensors) != set(other.tensors):
            return False
        if set(self.non_tensors) != set(other.non_tensors):
            return False
        return (
            all(tensors_equal(v, other.tensors[k]) for k, v in self.tensors.items())
            and all(arrays_equal(v, other.non_tensors[k]) for k, v in self.non_tensors.items())
            and values_equal(self.meta, other.meta)
        )

    def __repr__(self) -> str:
        tensors = ", ".join(f"{k}: {_describe_tensor(v)}" for k, v in self.tensors.items())
        non_tensors = ", ".join(
            f"{k}: {v.dtype}{list(v.shape)}" for k, v in self.non_tensors.items()
        )
        remote = f", remote={list(self.remote)}" if self.remote else ""
        return (
            f"Batch(len={len(self)}, tensors={{{tensors}}}, "
            f"non_tensors={{{non_tensors}}}{remote}, meta={list(self.meta)})"
        )

    def __reduce__(self) -> tuple:
        tensors = [(k, *encode_tensor(v)) for k, v in self.tensors.items()]
        non_tensors = [(k, *encode_objects(v)) for k, v in self.non_tensors.items()]
        remote = list(self.remote.items())  # a shared source is pickled once
        return _restore_batch, (_STATE_VERSION, tensors, non_tensors, self.meta, remote)


# ------------------------------------------------------------------ construction
def _make(tensors: dict, non_tensors: dict, meta: dict, remote: Remote | None = None) -> Batch:
    """Build a Batch from columns already known to be valid (no checks, no copies)."""
    batch = Batch.__new__(Batch)
    batch.tensors, batch.non_tensors, batch.meta = tensors, non_tensors, meta
    batch.remote = remote or {}
    return batch


def _checked_tensor(key: str, value: torch.Tensor) -> torch.Tensor:
    if value.dim() == 0:
        raise ValueError(
            f"Batch column {key!r} is a 0-d tensor; columns need a leading batch "
            "dimension (put per-batch values in meta)."
        )
    return value


def _to_column(key: str, value: Any) -> torch.Tensor | np.ndarray:
    """Sort one value into a tensor column or a non-tensor column."""
    if isinstance(value, torch.Tensor):
        return _checked_tensor(key, value)
    if isinstance(value, np.ndarray) and value.dtype.kind in _NUMERIC_KINDS:
        if value.ndim == 0:
            raise ValueError(f"Batch column {key!r} is a 0-d array; it needs a batch dimension.")
        return torch.from_numpy(_torch_compatible(value))
    return _to_non_tensor(key, value)


def _torch_compatible(array: np.ndarray) -> np.ndarray:
    """The array itself when torch.from_numpy can share it, else a compatible copy."""
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    if not array.flags.writeable or any(s < 0 for s in array.strides):
        array = np.array(array, copy=True)
    return array


def _to_non_tensor(key: str, value: Any) -> np.ndarray:
    """A numpy column; sequences become 1-D object arrays built element-wise."""
    if isinstance(value, np.ndarray):
        if value.ndim == 0:
            raise ValueError(f"Batch column {key!r} is a 0-d array; it needs a batch dimension.")
        if value.dtype.kind in "USVMm":  # strings, bytes, records, datetimes
            return value.astype(object)
        return value
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(
            f"Batch column {key!r} is a {type(value).__name__}, not a column; use a "
            "tensor, numpy array or list with one entry per row, or put per-batch "
            "values in meta."
        )
    return np.fromiter(value, dtype=object, count=len(value))


def _check_lengths(batch: Batch) -> None:
    first_key, first_len = None, None
    for key, column in [*batch.tensors.items(), *batch.non_tensors.items()]:
        n = int(column.shape[0])
        if first_key is None:
            first_key, first_len = key, n
        elif n != first_len:
            raise ValueError(
                f"Batch column {key!r} has {n} rows but column {first_key!r} has "
                f"{first_len} rows; every column must share the leading batch dimension."
            )


def _flatten_keys(keys: tuple) -> list[str]:
    if len(keys) == 1 and isinstance(keys[0], (list, tuple)):
        return list(keys[0])
    return list(keys)


def _row_indices(indices: Any, length: int) -> torch.Tensor:
    """Normalise a row selection to a 1-D non-negative int64 CPU tensor."""
    if isinstance(indices, torch.Tensor):
        idx = indices.detach().cpu()
    elif isinstance(indices, np.ndarray):
        idx = torch.from_numpy(np.array(indices, copy=True)) if indices.size else None
    else:
        indices = list(indices)
        idx = torch.as_tensor(indices) if indices else None
    if idx is None or idx.numel() == 0:
        return torch.zeros(0, dtype=torch.long)
    if idx.dtype == torch.bool:
        if idx.shape != (length,):
            raise IndexError(
                f"boolean mask of shape {tuple(idx.shape)} does not fit a Batch of {length} rows."
            )
        return idx.nonzero().squeeze(1)
    if idx.is_floating_point() or idx.is_complex() or idx.dim() != 1:
        raise IndexError(
            f"rows must be picked by a 1-D integer or boolean index, got {idx.dtype} "
            f"with shape {tuple(idx.shape)}."
        )
    idx = idx.long()
    lo, hi = int(idx.min()), int(idx.max())
    if lo < -length or hi >= length:
        bad = lo if lo < -length else hi
        raise IndexError(f"row {bad} is out of range for a Batch of {length} rows.")
    return torch.where(idx < 0, idx + length, idx) if lo < 0 else idx


def _check_same_columns(first: Batch, other: Batch, i: int) -> None:
    for kind, a, b in (
        ("tensor", first.tensors, other.tensors),
        ("non-tensor", first.non_tensors, other.non_tensors),
    ):
        if set(a) != set(b):
            missing = sorted(set(a) - set(b))
            extra = sorted(set(b) - set(a))
            raise ValueError(
                f"Batch.concat: batch {i} has different {kind} columns than batch 0: "
                f"missing {missing}, extra {extra}."
            )


def _concat_rows(batches: list[Batch], rows: Sequence[int]) -> Batch:
    """`Batch.concat(batches, rows)`: each batch's rows placed straight at their
    positions in the output (one copy per column)."""
    total = sum(len(b) for b in batches)
    order = torch.as_tensor(list(rows), dtype=torch.long)
    kept = len(order)
    within = kept <= total and (not kept or (int(order.min()) >= 0 and int(order.max()) < kept))
    if not within or not bool(torch.bincount(order, minlength=kept).eq(1).all()):
        raise ValueError(
            f"Batch.concat: rows must be a permutation of the first {kept} of the {total} "
            "stacked rows."
        )
    position = torch.empty(kept, dtype=torch.long)  # where stacked row j goes
    position[order] = torch.arange(kept)
    spans, start = [], 0  # (batch, its rows kept, their positions)
    for b in batches:
        n = max(0, min(len(b), kept - start))
        spans.append((b, n, position[start : start + n]))
        start += len(b)
    first = batches[0]
    tensors = {k: place_tensors(k, spans, kept) for k in first.tensors}
    non_tensors = {k: place_arrays(k, spans, kept) for k in first.non_tensors}
    remote = take_rows(concat_remote([b.remote for b in batches]), order)
    return _make(tensors, non_tensors, dict(first.meta), remote)


def _describe_tensor(t: torch.Tensor) -> str:
    text = f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
    return text if t.device.type == "cpu" else f"{text}@{t.device}"


# --------------------------------------------------------------- serialisation
def _restore_batch(
    version: int,
    tensors: list,
    non_tensors: list,
    meta: dict,
    remote: Sequence[tuple[str, RowSource]] = (),
) -> Batch:
    """Unpickle a Batch written by `Batch.__reduce__`."""
    if version != _STATE_VERSION:
        raise ValueError(
            f"cannot unpickle a Batch of format {version} with rayrl's format "
            f"{_STATE_VERSION}; use the same rayrl version on every node."
        )
    return _make(
        {key: decode_tensor(dtype, shape, wire, data) for key, dtype, shape, wire, data in tensors},
        {key: decode_objects(codec, payload) for key, codec, payload in non_tensors},
        meta,
        dict(remote),
    )
