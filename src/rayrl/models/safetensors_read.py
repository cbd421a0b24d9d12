"""Reading a Hugging Face model directory's safetensors one tensor at a time: the one
reader of safetensors files, for the training engine's load and the native rollout
engine's (`rayrl.rollout.native.weights.read_safetensors`).

`CheckpointIndex` lists every tensor of a directory (``model.safetensors``, or the
shards named by ``model.safetensors.index.json``) from the files' JSON headers: name,
dtype, shape and byte range. `CheckpointReader.read` then reads one tensor with a plain
positioned file read into a fresh host tensor, in the dtype it was saved in: no
memory map, so the pages of the whole file never count towards the reading process's
resident memory (a mapped 15 GB checkpoint would), and host memory holds one tensor at
a time. The reader counts the bytes it read (``bytes_read``, and in `rayrl.reads`);
`read_rows` reads a range of a tensor's first dimension alone (a rank's shard of it);
`read_part` a range of any dimension (a tensor-parallel rank's part).
"""

from __future__ import annotations

import io
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from rayrl import reads

__all__ = ["CheckpointIndex", "CheckpointReader", "TensorEntry"]

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class TensorEntry:
    """Where one saved tensor lies: its file, dtype, shape and absolute byte range."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


class CheckpointIndex(dict[str, TensorEntry]):
    """Saved tensor name -> `TensorEntry`, for a model directory's safetensors."""

    @classmethod
    def of(cls, path: str | os.PathLike[str]) -> CheckpointIndex:
        """The index of ``path``; FileNotFoundError when it holds no safetensors."""
        root = Path(path)
        sharded = root / "model.safetensors.index.json"
        if sharded.is_file():
            names = json.loads(sharded.read_text())["weight_map"]
            files = sorted({root / f for f in names.values()})
        else:
            files = sorted(root.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(
                f"{root} has no .safetensors weights; save the model with safetensors "
                "(transformers' save_pretrained does by default)"
            )
        index = cls()
        for file in files:
            index.update(_header(file))
        return index

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.values())


def _header(file: Path) -> dict[str, TensorEntry]:
    """The tensors of one safetensors file, from its length-prefixed JSON header."""
    with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    base = 8 + size
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in _DTYPES:
            raise ValueError(
                f"{file}: tensor {name} has dtype {meta['dtype']}, which rayrl cannot read"
            )
        start, end = meta["data_offsets"]
        out[name] = TensorEntry(
            file, _DTYPES[meta["dtype"]], tuple(meta["shape"]), base + start, base + end
        )
    return out


class CheckpointReader:
    """Reads tensors of a `CheckpointIndex`, keeping its files open until `close`."""

    def __init__(self, index: CheckpointIndex) -> None:
        self.index = index
        self.bytes_read = 0
        self._files: dict[Path, io.FileIO] = {}

    def read(self, name: str) -> Tensor:
        """The tensor ``name`` in its saved dtype, in host memory of its own."""
        entry = self.index[name]
        return self._read(entry, name, entry.start, entry.nbytes).reshape(entry.shape)

    def read_rows(self, name: str, start: int, stop: int) -> Tensor:
        """Rows ``start:stop`` of the tensor ``name`` (its first dimension), read alone:
        a row-major tensor's rows lie in one byte range of the file."""
        entry = self.index[name]
        rows = entry.shape[0] if entry.shape else 1
        start, stop = max(0, min(start, rows)), max(0, min(stop, rows))
        stop = max(start, stop)
        row_bytes = entry.nbytes // rows if rows else 0
        raw = self._read(entry, name, entry.start + start * row_bytes, (stop - start) * row_bytes)
        return raw.reshape((stop - start, *entry.shape[1:]))

    def read_part(self, name: str, dim: int, start: int, stop: int) -> Tensor:
        """``start:stop`` of dimension ``dim`` of the tensor ``name``: the rows alone for
        the first dimension, else the whole tensor read and the part copied out of it."""
        if dim == 0:
            return self.read_rows(name, start, stop)
        return self.read(name).narrow(dim, start, stop - start).contiguous()

    def _read(self, entry: TensorEntry, name: str, offset: int, nbytes: int) -> Tensor:
        """``nbytes`` of ``entry``'s file from ``offset``, viewed in its dtype."""
        handle = self._files.get(entry.file)
        if handle is None:
            handle = self._files[entry.file] = io.FileIO(entry.file, "rb")
        raw = torch.empty(nbytes, dtype=torch.uint8)
        handle.seek(offset)
        view = memoryview(raw.numpy())
        done = 0
        while done < nbytes:
            got = handle.readinto(view[done:])
            if not got:
                raise OSError(f"{entry.file} ended inside tensor {name}: the file is truncated")
            done += got
        self.bytes_read += nbytes
        reads.count(nbytes)
        return raw.view(entry.dtype)

    def close(self) -> None:
        for handle in self._files.values():
            handle.close()
        self._files.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
