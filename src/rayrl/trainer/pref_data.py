"""The preference pairs a `rayrl rm` or `rayrl dpo` run trains and validates on.

From `data.train_files` / `data.val_files` (parquet, `data.prompt_key` /
`chosen_key` / `rejected_key`, the first `train_max_samples` / `val_max_samples` rows
when set); with no train files, from the synthetic task `data.synthetic_task`
(`rayrl.data.synthetic.preference_pairs`: chosen the right answer, rejected the task's
typical mistake), validated on its held-out pairs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rayrl.config.pref import PrefConfig
from rayrl.data import RowSource, read_rows_with_sources
from rayrl.data.preference import PairDataset
from rayrl.data.synthetic import preference_pairs


def _dataset(
    cfg: PrefConfig,
    tokenizer: Any,
    rows: list[dict[str, Any]],
    encoding: str,
    sources: Sequence[RowSource] | None = None,
) -> PairDataset:
    d = cfg.data
    return PairDataset(
        rows,
        tokenizer,
        encoding=encoding,
        prompt_key=d.prompt_key,
        chosen_key=d.chosen_key,
        rejected_key=d.rejected_key,
        max_length=d.max_length,
        truncation=d.truncation,
        chat_template_kwargs=d.apply_chat_template_kwargs,
        sources=sources,
    )


def _files(
    cfg: PrefConfig, tokenizer: Any, files: list[str], limit: int, encoding: str
) -> PairDataset:
    rows, sources = read_rows_with_sources(files)
    if limit > 0:
        rows, sources = rows[:limit], sources[:limit]
    return _dataset(cfg, tokenizer, rows, encoding, sources)


def synthetic_pair_rows(cfg: PrefConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training pairs, held-out pairs) of the synthetic task, in the config's columns."""
    d = cfg.data
    train, val = preference_pairs(
        d.synthetic_task, d.synthetic_size, cfg.trainer.seed, d.synthetic_val_size
    )
    rename = {"prompt": d.prompt_key, "chosen": d.chosen_key, "rejected": d.rejected_key}
    return (
        [{rename.get(k, k): v for k, v in row.items()} for row in train],
        [{rename.get(k, k): v for k, v in row.items()} for row in val],
    )


def load_pair_datasets(
    cfg: PrefConfig, tokenizer: Any, encoding: str
) -> tuple[PairDataset, PairDataset | None]:
    """(training pairs, validation pairs or None), tokenized for `encoding` (``policy``
    for DPO, ``score`` for a reward model: `rayrl.data.preference`)."""
    d = cfg.data
    if d.train_files:
        train = _files(cfg, tokenizer, d.train_files, d.train_max_samples, encoding)
        val = (
            _files(cfg, tokenizer, d.val_files, d.val_max_samples, encoding)
            if d.val_files
            else None
        )
    else:
        train_rows, val_rows = synthetic_pair_rows(cfg)
        train = _dataset(cfg, tokenizer, train_rows, encoding)
        val = _dataset(cfg, tokenizer, val_rows, encoding) if val_rows else None
    return train, (val if val is not None and len(val) else None)
