"""A dataset class of one's own (verl's `data.custom_cls`) as the rows of a prompt dataset.

The contract is verl's: the class is built as `cls(data_files=FILES, tokenizer=TOKENIZER,
processor=None, config=DATA_CONFIG, max_samples=-1)` (`config` is the run's `data`
group as an OmegaConf DictConfig: `config.get("prompt_key", "prompt")` works) and is a
map-style dataset: `len(ds)` rows, `ds[i]` a dict. A row holds its chat messages under
`raw_prompt` (what verl's `RLHFDataset.__getitem__` returns) or under
`data.prompt_key`, and verl's other columns: `data_source`, `reward_model:
{ground_truth}`, `extra_info`, optionally `agent_name`. Tensors and arrays in a row
(verl's `dummy_tensor`, token ids a class computed) are dropped: rayrl renders the
messages with the chat template itself, as verl's agent loop does with `raw_prompt`.
Each row then goes through `PromptDataset`'s checks like a parquet row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from rayrl.data.dataset import RowSource
from rayrl.data.errors import DataError

RAW_PROMPT = "raw_prompt"


def build_custom_dataset(
    cls: Any, files: Sequence[str], tokenizer: Any, data_config: Any, where: str
) -> Any:
    """An instance of the user's class `cls` on `files` (verl's constructor call);
    `where` names the class in errors."""
    if not callable(cls):
        raise DataError(f"{where} is a {type(cls).__name__}, not a dataset class")
    try:
        dataset = cls(
            data_files=list(files),
            tokenizer=tokenizer,
            processor=None,
            config=data_config,
            max_samples=-1,
        )
    except TypeError as err:
        raise DataError(
            f"{where}({err}): rayrl builds it as verl does, cls(data_files=..., "
            "tokenizer=..., processor=None, config=<the data group>, max_samples=-1)"
        ) from err
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise DataError(f"{where}: the dataset needs __len__ and __getitem__ (a map-style Dataset)")
    return dataset


def custom_rows(
    dataset: Any, prompt_key: str, where: str
) -> tuple[list[dict[str, Any]], list[RowSource]]:
    """Every row of `dataset` in order, as a prompt row (messages under `prompt_key`),
    and where each comes from (`where`, its index)."""
    rows, sources = [], []
    for i in range(len(dataset)):
        item = dataset[i]
        if not isinstance(item, dict):
            raise DataError(f"{where}[{i}] is a {type(item).__name__}; rows must be dicts")
        row = {k: v for k, v in item.items() if not isinstance(v, torch.Tensor | np.ndarray)}
        if RAW_PROMPT in row:
            row[prompt_key] = row.pop(RAW_PROMPT)
        elif prompt_key not in row:
            raise DataError(
                f"{where}[{i}] has neither {RAW_PROMPT!r} nor {prompt_key!r} (data.prompt_key): "
                f"a row holds its chat messages under one of them; it has {sorted(item)}"
            )
        rows.append(row)
        sources.append(RowSource(where, i))
    return rows, sources
