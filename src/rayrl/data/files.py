"""Reading a data file's rows as verl does: Parquet, or JSON by its extension.

verl's datasets read `.json` and `.jsonl` files as JSON (Hugging Face `datasets`' JSON
builder) and every other file as Parquet. `read_rows` does the same: a `.jsonl` file
holds one JSON object per line; a `.json` file holds a list of objects, an object of
equal-length column lists, or objects one per line. A file that is not what its name
says is a DataError naming the file and what it holds instead, not a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import pyarrow as pa
import pyarrow.parquet as pq

from rayrl.data.errors import DataError, DataFileNotFoundError

JSON_SUFFIXES = (".json", ".jsonl")


def is_json(path: str | Path) -> bool:
    """Whether `path` is read as JSON (by its extension, as verl decides)."""
    return Path(path).suffix.lower() in JSON_SUFFIXES


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of one data file (module docstring)."""
    file = Path(path)
    if not file.is_file():
        raise DataFileNotFoundError(f"data file {path} not found (data.train_files / val_files)")
    if is_json(file):
        return _json_rows(file)
    try:
        return cast("list[dict[str, Any]]", pq.read_table(file).to_pylist())
    except (pa.ArrowInvalid, OSError) as err:
        raise DataError(
            f"data file {file} is not a Parquet file ({err}); rayrl reads Parquet, and "
            "JSON from files named .json or .jsonl (as verl does): rename it, or convert "
            "it (rayrl data convert)"
        ) from None


def _json_rows(file: Path) -> list[dict[str, Any]]:
    text = file.read_text(encoding="utf-8")
    if file.suffix.lower() == ".json":
        try:
            whole = json.loads(text)
        except json.JSONDecodeError:
            pass  # objects one per line, as .jsonl
        else:
            return _rows_of(whole, file)
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(
                f"data file {file} line {number} is not JSON ({err.msg} at column "
                f"{err.colno}); each line of a JSON Lines file is one row, a JSON object"
            ) from None
        if not isinstance(row, dict):
            raise DataError(
                f"data file {file} line {number} is a JSON {type(row).__name__}, not an "
                "object; each line is one row, an object of its columns"
            )
        rows.append(row)
    return rows


def _rows_of(whole: object, file: Path) -> list[dict[str, Any]]:
    """A whole-file JSON value as rows: a list of objects or an object of columns."""
    if isinstance(whole, list) and all(isinstance(row, dict) for row in whole):
        return whole
    if isinstance(whole, dict) and all(isinstance(col, list) for col in whole.values()):
        lengths = {len(col) for col in whole.values()}
        if len(lengths) <= 1:
            count = lengths.pop() if lengths else 0
            return [{key: col[i] for key, col in whole.items()} for i in range(count)]
    raise DataError(
        f"data file {file} holds a JSON {type(whole).__name__} that is neither a list of "
        "row objects nor an object of equal-length column lists"
    )
