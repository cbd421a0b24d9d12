"""Prompt datasets in verl's row format: parquet in, left-padded prompt Batches out.

A row has `data_source`, `prompt` (chat messages), `ability`, `reward_model: {style,
ground_truth}` and `extra_info`, so verl's datasets work as they are. Rows that cannot
be used (missing columns, a prompt that is not a list of messages, a prompt longer than
`max_prompt_length` when truncation is "error") are not dropped silently: each lands
in `PromptDataset.rejected` with its position and reason, and the count is logged.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from rayrl.batch import Batch

log = logging.getLogger(__name__)
REQUIRED = ("data_source", "reward_model")


@dataclass(frozen=True)
class RejectedRow:
    """A row that was set aside: where it came from and why."""

    index: int
    reason: str


def read_parquet(files: str | Path | Sequence[str | Path]) -> list[dict]:
    """All rows of one or more parquet files, in order."""
    paths = [files] if isinstance(files, str | Path) else list(files)
    rows: list[dict] = []
    for path in paths:
        if not Path(path).is_file():
            raise FileNotFoundError(f"data file {path} not found (data.train_files / val_files)")
        rows.extend(pq.read_table(path).to_pylist())
    return rows


def write_parquet(rows: Sequence[dict], path: str | Path) -> Path:
    """Write rows to a parquet file (parent folders created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(list(rows)), path)
    return path


def _row_problem(row: object, prompt_key: str) -> str | None:
    if not isinstance(row, dict):
        return f"a row must be a mapping, got {type(row).__name__}"
    missing = [k for k in (*REQUIRED, prompt_key) if row.get(k) is None]
    if missing:
        return f"missing column(s) {', '.join(missing)}"
    messages = row[prompt_key]
    if not isinstance(messages, list | tuple) or not all(
        isinstance(m, dict) and "role" in m and "content" in m for m in messages
    ):
        return f"'{prompt_key}' must be a list of {{role, content}} messages"
    if not isinstance(row["reward_model"], dict) or "ground_truth" not in row["reward_model"]:
        return "reward_model must be a mapping with a ground_truth"
    return None


class PromptDataset:
    """Tokenized prompts (chat template applied) with over-long and malformed rows set aside."""

    def __init__(
        self,
        rows: Sequence[dict],
        tokenizer,
        *,
        max_prompt_length: int,
        truncation: str = "error",
        filter_overlong: bool = True,
        prompt_key: str = "prompt",
    ) -> None:
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.rows: list[dict] = []
        self.prompt_ids: list[list[int]] = []
        self.positions: list[int] = []  # index of each kept row in the input
        self.rejected: list[RejectedRow] = []
        for i, row in enumerate(rows):
            problem = _row_problem(row, prompt_key)
            ids = None if problem else self._encode(row[prompt_key])
            if ids is not None and len(ids) > max_prompt_length:
                ids, problem = self._fit(ids, truncation, filter_overlong, i)
            if problem:
                self.rejected.append(RejectedRow(i, problem))
                continue
            self.rows.append(row)
            self.prompt_ids.append(ids)
            self.positions.append(i)
        if self.rejected:
            first = self.rejected[0]
            log.warning(
                "%d of %d rows set aside (first: row %d, %s); see PromptDataset.rejected",
                len(self.rejected),
                len(rows),
                first.index,
                first.reason,
            )

    def _encode(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=True
        )
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _fit(self, ids: list[int], truncation: str, filter_overlong: bool, i: int):
        limit = self.max_prompt_length
        if truncation == "left":
            return ids[-limit:], None
        if truncation == "right":
            return ids[:limit], None
        reason = f"prompt of {len(ids)} tokens is over data.max_prompt_length={limit}"
        if filter_overlong:
            return ids, reason
        raise ValueError(
            f"row {i}: {reason}; raise max_prompt_length, set data.truncation=left|right, "
            "or data.filter_overlong_prompts=true to set such rows aside"
        )

    def __len__(self) -> int:
        return len(self.rows)

    def order(self, epoch: int, seed: int, shuffle: bool = True) -> list[int]:
        """The row order of an epoch: a permutation seeded by (seed, epoch) when shuffling."""
        indices = list(range(len(self)))
        if shuffle:
            random.Random(f"{seed}:{epoch}").shuffle(indices)
        return indices

    def collate(self, indices: Sequence[int]) -> Batch:
        """Left-padded `input_ids`, `attention_mask`, `position_ids` plus the row columns."""
        pad_id = self.tokenizer.pad_token_id
        width = max((len(self.prompt_ids[i]) for i in indices), default=0)
        ids = torch.full((len(indices), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(indices), width), dtype=torch.long)
        for row, i in enumerate(indices):
            seq = self.prompt_ids[i]
            if seq:
                ids[row, width - len(seq) :] = torch.tensor(seq)
                mask[row, width - len(seq) :] = 1
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)

        def column(fn) -> np.ndarray:
            out = np.empty(len(indices), dtype=object)
            out[:] = [fn(i) for i in indices]
            return out

        return Batch(
            tensors={"input_ids": ids, "attention_mask": mask, "position_ids": position_ids},
            non_tensors={
                "uid": column(lambda i: f"p{self.positions[i]}"),
                "data_source": column(lambda i: self.rows[i]["data_source"]),
                "ground_truth": column(lambda i: self.rows[i]["reward_model"]["ground_truth"]),
                "extra_info": column(lambda i: self.rows[i].get("extra_info") or {}),
                "raw_prompt": column(lambda i: self.rows[i]["prompt"]),
            },
        )

    def batches(
        self, batch_size: int, *, epoch: int, seed: int, shuffle: bool = True, start: int = 0
    ) -> Iterator[Batch]:
        """Whole batches of an epoch from batch number `start` (the dataloader position)."""
        order = self.order(epoch, seed, shuffle)
        for b in range(start, len(order) // batch_size):
            yield self.collate(order[b * batch_size : (b + 1) * batch_size])
