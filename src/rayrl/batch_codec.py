"""How one Batch column travels through pickle and Ray's object store.

A tensor becomes a flat uint8 numpy view of its contiguous CPU bytes, which pickle
protocol 5 (and so Ray) ships out-of-band without `torch.save`; a slice ships only
its own rows. Where the data crosses machines (`narrow_integers(True)`: a cluster of
several nodes), an integer tensor whose values fit a narrower integer type travels in
the narrowest that holds them (token ids of a 150k vocabulary as int32, masks as
uint8, positions as int16) and arrives in its own dtype with the same values: the
bytes on the wire shrink, what the receiver reads is bitwise the same. On one machine
the bytes are shared memory, so narrowing would only cost a scan and a widening copy:
it is off. A 1-D column of str/None becomes Arrow's layout of a string array (UTF-8
data, int64 offsets and a validity bitmap when there are None) held in plain numpy
arrays, which Ray moves out-of-band like any array and Arrow turns back into strings
faster than unpickling one object per row. Any other column is pickled as it is.

On the way back a tensor is a view of the bytes it arrived in, never a copy (a
narrowed one excepted: it is widened into a private tensor): from
Ray's object store that is shared, read-only memory, as numpy arrays from `ray.get`
are. Such a tensor must not be written in place (Ray's numpy arrays refuse it; torch
cannot): other readers of the object on the node, and later gets of it, would see
the write. `Batch.writable()` gives private copies where a worker needs them.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

__all__ = ["decode_objects", "decode_tensor", "encode_objects", "encode_tensor"]

# torch warns on every tensor made over a read-only array; here that is by design.
warnings.filterwarnings(
    "ignore",
    message="The given NumPy array is not writable",
    category=UserWarning,
    module=__name__,
)


# The integer types a wider integer tensor may travel in, narrowest first, with the
# range of values each holds.
_WIRE_INTS = [
    (dtype, torch.iinfo(dtype).min, torch.iinfo(dtype).max)
    for dtype in (torch.uint8, torch.int16, torch.int32)
]


_NARROW = [False]  # this process's setting (`narrow_integers`)


def narrow_integers(on: bool) -> None:
    """Whether this process sends integer tensors narrowed (see the module docstring);
    a WorkerGroup turns it on in the driver and in its workers when the cluster has
    several nodes."""
    _NARROW[0] = bool(on)


def encode_tensor(
    t: torch.Tensor,
) -> tuple[torch.dtype, tuple[int, ...], torch.dtype, np.ndarray]:
    """(dtype, shape, wire dtype, uint8 numpy view of the contiguous CPU bytes in the
    wire dtype); detaches, moves to CPU. The wire dtype is `wire_dtype`'s choice."""
    flat = t.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)
    wire = wire_dtype(flat)
    if wire != t.dtype:
        flat = flat.to(wire)
    return t.dtype, tuple(t.shape), wire, flat.view(torch.uint8).numpy()


def wire_dtype(t: torch.Tensor) -> torch.dtype:
    """The narrowest integer dtype that holds every value of integer tensor `t`
    (uint8, int16 or int32, when narrower than its own) where narrowing is on; else
    `t`'s dtype."""
    if not _NARROW[0] or t.dtype not in (torch.int16, torch.int32, torch.int64) or t.numel() == 0:
        return t.dtype
    low, high = (int(v) for v in torch.aminmax(t))
    for dtype, lowest, highest in _WIRE_INTS:
        if dtype.itemsize >= t.element_size():
            break
        if lowest <= low and high <= highest:
            return dtype
    return t.dtype


def decode_tensor(
    dtype: torch.dtype, shape: tuple[int, ...], wire: torch.dtype, data: np.ndarray
) -> torch.Tensor:
    """Rebuild a CPU tensor from `encode_tensor`'s output, sharing its buffer.

    The buffer is copied only when it is misaligned for the dtype, or when the tensor
    travelled narrowed (it is widened back to `dtype`). A read-only buffer (Ray's
    object store) is shared too: see the module docstring.
    """
    if data.ctypes.data % wire.itemsize == 0:
        out = torch.from_numpy(data).view(wire).reshape(shape)
    else:
        out = torch.empty(shape, dtype=wire)
        np.copyto(out.reshape(-1).view(torch.uint8).numpy(), data)
    return out if wire == dtype else out.to(dtype)


_TEXT_TYPES = {str, type(None)}


def encode_objects(column: np.ndarray) -> tuple[str, Any]:
    """("utf8", (rows, validity, offsets, data)) for a non-empty 1-D column of str/None,
    else ("numpy", column)."""
    is_text = column.dtype == object and column.ndim == 1 and column.size > 0
    if is_text and set(map(type, column)) <= _TEXT_TYPES:
        import pyarrow as pa

        try:
            text = pa.array(column, type=pa.large_string(), from_pandas=False)
        except (UnicodeEncodeError, pa.ArrowException):
            return "numpy", column  # e.g. lone surrogates: pickle keeps them exactly
        valid, offsets, data = text.buffers()
        return "utf8", (
            len(text),
            None if valid is None else np.frombuffer(valid, dtype=np.uint8),
            np.frombuffer(offsets, dtype=np.int64),
            np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, np.uint8),
        )
    return "numpy", column


def decode_objects(codec: str, payload: Any) -> np.ndarray:
    """The column `encode_objects` encoded: a 1-D object array of str/None, or as it was."""
    if codec == "utf8":
        import pyarrow as pa

        n, valid, offsets, data = payload
        buffers = [None if valid is None else pa.py_buffer(valid), pa.py_buffer(offsets)]
        text = pa.LargeStringArray.from_buffers(n, buffers[1], pa.py_buffer(data), buffers[0])
        return text.to_numpy(zero_copy_only=False)
    return payload
