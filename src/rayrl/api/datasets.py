"""The Python API's datasets: rows in memory or in files, in TRL's columns or rayrl's,
written as rayrl's parquet files under the run directory.

`GRPOTrainer` takes a dataset as a list of dicts, a pandas DataFrame, a Hugging Face
`datasets.Dataset` (duck-typed: neither library is imported here), or the path(s) of
data files (Parquet, JSON, JSONL: `rayrl.data.files`). Its rows are in either layout:

- TRL's prompt-only layout: `prompt` (a string, or chat messages) and any other
  columns. A string becomes one user message (rayrl's prompts go through the chat
  template). Every other column reaches the reward functions (`extra_info`, with the
  original prompt under `rayrl.rewards.callables.PROMPT_KEY`); `data_source` names the
  rows' source in the metrics (default `DEFAULT_SOURCE`) and `ground_truth` is what
  rayrl-signature functions get as theirs (default "").
- rayrl's (verl's) layout, told by its `reward_model` column: kept as it is.

Rows in memory are written to `<output_dir>/data/<split>-<digest>.parquet` and read back through
the normal data path, so one path serves every run. Files already in rayrl's layout are
read where they are; files in TRL's layout are converted like rows in memory.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import pyarrow as pa

from rayrl.data import DataError, write_parquet
from rayrl.data.files import read_rows
from rayrl.rewards.callables import PROMPT_KEY

DEFAULT_SOURCE = "custom"  # the data_source of TRL-layout rows that name none
PathLike = str | os.PathLike[str]


@runtime_checkable
class DataFrameLike(Protocol):
    """A pandas DataFrame, as far as it is used here."""

    columns: Iterable[str]

    def to_dict(self, orient: str) -> list[dict[str, object]]: ...


@runtime_checkable
class HFDatasetLike(Protocol):
    """A Hugging Face `datasets.Dataset`, as far as it is used here."""

    def to_list(self) -> list[dict[str, object]]: ...


DatasetLike = (
    Sequence[Mapping[str, object]] | DataFrameLike | HFDatasetLike | PathLike | Sequence[PathLike]
)


@dataclass(frozen=True)
class DataFiles:
    """A dataset's files in rayrl's layout and the columns its reward functions get."""

    files: list[str]
    columns: frozenset[str]


def dataset_files(data: DatasetLike, out_dir: Path, split: str) -> DataFiles:
    """The data files of `data` for `data.train_files` / `data.val_files`: its own files
    when they are in rayrl's layout, else `<out_dir>/<split>-<digest>.parquet` (module
    docstring; named by content, so a run never rewrites a file another one reads)."""
    paths = _paths(data)
    rows = [row for p in paths for row in read_rows(os.fspath(p))] if paths is not None else None
    if paths is not None and rows and all("reward_model" in row for row in rows):
        files = [str(Path(p).expanduser().absolute()) for p in paths]
        return DataFiles(files, _columns(rows))
    rows = dataset_rows(data) if rows is None else rows
    if not rows:
        raise DataError(f"the {split} dataset has no rows")
    converted = [rayrl_row(row, i) for i, row in enumerate(_filled(rows))]
    return DataFiles([str(_write(converted, out_dir, split))], _columns(converted))


def _filled(rows: list[dict[str, object]]) -> list[dict[str, object]]:
    """Rows with every column of any row, None where a row lacks it (as in a table)."""
    keys = list(dict.fromkeys(key for row in rows for key in row))
    return [{key: row.get(key) for key in keys} for row in rows]


def _columns(rows: list[dict[str, object]]) -> frozenset[str]:
    """The extra columns of rows in rayrl's layout (their `extra_info` keys)."""
    keys = {k for row in rows if isinstance(info := row.get("extra_info"), dict) for k in info}
    return frozenset(keys - {PROMPT_KEY})


def _write(rows: list[dict[str, object]], out_dir: Path, split: str) -> Path:
    """`rows` as `<out_dir>/<split>-<digest>.parquet` (written once, atomically)."""
    text = json.dumps(rows, sort_keys=True, default=repr)
    path = out_dir / f"{split}-{hashlib.sha1(text.encode()).hexdigest()[:12]}.parquet"
    if path.is_file():
        return path
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write_parquet(rows, partial)
    except (TypeError, ValueError, pa.ArrowException) as err:  # a column of mixed types
        partial.unlink(missing_ok=True)
        raise DataError(
            f"the {split} dataset cannot be written as parquet ({err}): each column needs "
            "one type in every row (numbers, strings, lists, dicts of those)"
        ) from None
    partial.replace(path)
    return path


def _paths(data: object) -> list[PathLike] | None:
    """`data` as a list of file paths, or None when it is rows."""
    if isinstance(data, str | os.PathLike):
        return [data]
    if isinstance(data, Sequence) and data and all(isinstance(d, str | os.PathLike) for d in data):
        return list(data)
    return None


def dataset_rows(data: object) -> list[dict[str, object]]:
    """The rows of a list of dicts, a DataFrame or a Hugging Face Dataset."""
    if isinstance(data, DataFrameLike) and not isinstance(data, Sequence):
        return [_plain_row(row) for row in data.to_dict("records")]
    if isinstance(data, HFDatasetLike) and not isinstance(data, Sequence):
        return [_plain_row(row) for row in data.to_list()]
    if isinstance(data, Sequence) and all(isinstance(row, Mapping) for row in data):
        return [_plain_row(dict(row)) for row in data]
    raise TypeError(
        f"a dataset must be a list of dicts, a pandas DataFrame, a datasets.Dataset or "
        f"data file path(s); got {type(data).__name__}"
    )


def _plain_row(row: Mapping[Any, object]) -> dict[str, object]:
    """A row with its cells as Python values (`_plain`)."""
    return {str(k): _plain(v) for k, v in row.items()}


def _plain(value: object) -> object:
    """Numpy scalars and arrays (a DataFrame's cells) as Python values; NaN as None."""
    if isinstance(value, Mapping):
        return _plain_row(value)
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if hasattr(value, "tolist") and not isinstance(value, str | bytes):
        return _plain(value.tolist())
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def rayrl_row(row: dict[str, object], index: int) -> dict[str, object]:
    """One row in rayrl's layout (module docstring); DataError naming the row when it
    has no usable prompt."""
    if "reward_model" in row:
        return row
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and all(isinstance(m, Mapping) for m in prompt) and prompt:
        messages = prompt
    else:
        raise DataError(
            f"dataset row {index}: 'prompt' must be a string or a list of chat messages "
            f"({{role, content}}); got {type(prompt).__name__} (columns: {', '.join(row)})"
        )
    columns = {k: v for k, v in row.items() if k != "prompt"}
    ground_truth = row.get("ground_truth")
    return {
        "data_source": str(row.get("data_source") or DEFAULT_SOURCE),
        "prompt": messages,
        "reward_model": {
            "style": "rule",
            "ground_truth": "" if ground_truth is None else ground_truth,
        },
        "extra_info": {**columns, PROMPT_KEY: prompt},
    }
