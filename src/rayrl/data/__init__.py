"""Data: verl-format prompt rows (parquet or synthetic) turned into left-padded Batches."""

from rayrl.data.dataset import (
    PromptDataset,
    RejectedRow,
    RowSource,
    read_parquet,
    read_rows_with_sources,
    write_parquet,
)
from rayrl.data.errors import DataError
from rayrl.data.synthetic import SYNTHETIC_TASKS, VISUAL_TASKS, synthetic_rows

__all__ = [
    "SYNTHETIC_TASKS",
    "VISUAL_TASKS",
    "DataError",
    "PromptDataset",
    "RejectedRow",
    "RowSource",
    "read_parquet",
    "read_rows_with_sources",
    "synthetic_rows",
    "write_parquet",
]
