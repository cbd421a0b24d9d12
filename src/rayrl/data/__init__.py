"""Data: verl-format prompt rows (parquet or synthetic) turned into left-padded Batches."""

from rayrl.data.dataset import PromptDataset, RejectedRow, read_parquet, write_parquet
from rayrl.data.synthetic import SYNTHETIC_TASKS, synthetic_rows

__all__ = [
    "SYNTHETIC_TASKS",
    "PromptDataset",
    "RejectedRow",
    "read_parquet",
    "synthetic_rows",
    "write_parquet",
]
