"""Supervised fine-tuning data: (prompt, response) rows in, Batches the engine trains on.

Rows come from parquet files with verl's SFT columns: `data.prompt_key` holds the
prompt, either a string (one user turn) or a list of chat messages, and
`data.response_key` the response string; `prompt_dict_keys` / `response_dict_keys`
reach into nested columns (verl's GSM8K: `prompt_key=extra_info`,
`prompt_dict_keys=[question]`). The prompt goes through the chat template with the
generation prompt (as `rayrl train` renders prompts), the response is followed by the
tokenizer's end-of-sequence token (so the model learns to stop), and the two are
tokenized apart, as they are when a policy generates.

A collated batch has the layout of a rollout: left-padded prompt, right-padded
response, `responses` and `response_mask`; the engine computes log-probs over the
response columns only, so the loss covers response tokens and nothing else.

Rows that cannot be used are set aside with their file, row number and reason (a
missing key, an empty prompt or response, malformed messages, a response truncation
leaves empty); a row longer than `data.max_length` is cut (`truncation=left|right`) or
stops the load with its file and row (`error`, verl's default).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from rayrl.batch import Batch
from rayrl.data.dataset import (
    DataError,
    RejectedRow,
    RowSource,
    epoch_order,
    messages_problem,
    require_rows,
)

log = logging.getLogger(__name__)


def _field(row: Any, key: str, nested: Sequence[str]) -> tuple[Any, str | None]:
    """`row[key][nested[0]][nested[1]]...`, or why it is not there."""
    if not isinstance(row, dict):
        return None, f"a row must be a mapping, got {type(row).__name__}"
    value, path = row.get(key), key
    if value is None:
        return None, f"missing column '{key}'"
    for name in nested:
        if not isinstance(value, dict) or name not in value:
            return None, f"no '{name}' in column '{path}'"
        value, path = value[name], f"{path}.{name}"
    if value is None:
        return None, f"missing column '{path}'"
    return value, None


def _messages(prompt: Any, key: str) -> tuple[list[dict] | None, str | None]:
    if isinstance(prompt, str):
        if not prompt.strip():
            return None, f"'{key}' is an empty string"
        return [{"role": "user", "content": prompt}], None
    messages = list(prompt) if isinstance(prompt, list | tuple | np.ndarray) else prompt
    problem = messages_problem(messages, key)
    return (None, problem) if problem else (messages, None)


class SFTDataset:
    """Tokenized (prompt, response) pairs; unusable rows set aside in `rejected`."""

    def __init__(
        self,
        rows: Sequence[dict],
        tokenizer: Any,
        *,
        prompt_key: str = "question",
        response_key: str = "answer",
        prompt_dict_keys: Sequence[str] = (),
        response_dict_keys: Sequence[str] = (),
        max_length: int = 1024,
        truncation: str = "error",
        chat_template_kwargs: dict | None = None,
        sources: Sequence[RowSource] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_length, self.truncation = max_length, truncation
        self.keys = (prompt_key, tuple(prompt_dict_keys), response_key, tuple(response_dict_keys))
        self.template_kwargs = dict(chat_template_kwargs or {})
        self.prompt_ids: list[list[int]] = []
        self.response_ids: list[list[int]] = []
        self.rejected: list[RejectedRow] = []
        self.total_rows = len(rows)
        for i, row in enumerate(rows):
            source = sources[i] if sources is not None else None
            pair, problem = self._encode(row)
            if pair is not None:
                pair, problem = self._fit(*pair, source or f"row {i}")
            if problem:
                self.rejected.append(RejectedRow(i, problem, source))
                continue
            self.prompt_ids.append(pair[0])
            self.response_ids.append(pair[1])
        if self.rejected:
            log.info(
                "%d of %d SFT rows set aside (first: %s); each is in .rejected",
                len(self.rejected),
                len(rows),
                self.rejected[0],
            )

    def _encode(self, row: Any) -> tuple[tuple[list[int], list[int]] | None, str | None]:
        prompt_key, prompt_nested, response_key, response_nested = self.keys
        prompt, problem = _field(row, prompt_key, prompt_nested)
        if problem:
            return None, problem
        response, problem = _field(row, response_key, response_nested)
        if problem:
            return None, problem
        if not isinstance(response, str) or not response.strip():
            return None, f"'{response_key}' must be a non-empty string, got {response!r}"
        messages, problem = _messages(prompt, prompt_key)
        if problem:
            return None, problem
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **self.template_kwargs
            )
        except Exception as exc:  # noqa: BLE001 - a template's own error, kept as the reason
            return None, f"the chat template failed: {type(exc).__name__}: {exc}"
        eos = self.tokenizer.eos_token or ""
        encode = self.tokenizer
        prompt_ids = encode(text, add_special_tokens=False)["input_ids"]
        return (prompt_ids, encode(response + eos, add_special_tokens=False)["input_ids"]), None

    def _fit(self, prompt: list[int], response: list[int], where: object):
        """Apply `data.truncation` to a pair over `max_length` tokens."""
        limit, total = self.max_length, len(prompt) + len(response)
        if total <= limit:
            return (prompt, response), None
        if self.truncation == "error":
            raise DataError(
                f"{where}: prompt {len(prompt)} + response {len(response)} = {total} tokens is "
                f"over data.max_length={limit}; raise data.max_length or set "
                "data.truncation=left (drop the start) or right (drop the end)"
            )
        if self.truncation == "left":  # the prompt's start goes first, then the response's
            cut = total - limit
            if cut < len(prompt):
                return (prompt[cut:], response), None
            return ([], response[cut - len(prompt) :]), None
        if len(prompt) >= limit:
            return None, f"the prompt alone ({len(prompt)} tokens) fills data.max_length={limit}"
        return (prompt, response[: limit - len(prompt)]), None

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def require_rows(self, needed: int, key: str = "data.train_batch_size") -> None:
        """Raise DataError unless at least `needed` rows are usable (one batch)."""
        require_rows(self, needed, key, what="the SFT data")

    def order(self, epoch: int, seed: int, shuffle: bool = True) -> list[int]:
        """The row order of an epoch: a permutation seeded by (seed, epoch) when shuffling."""
        return epoch_order(len(self), epoch, seed, shuffle)

    def collate(self, indices: Sequence[int]) -> Batch:
        """Left-padded prompts, right-padded responses: `input_ids`, `attention_mask`,
        `position_ids` over both, and `responses`, `response_mask` over the responses."""
        pad = self.tokenizer.pad_token_id
        pad = pad if pad is not None else self.tokenizer.eos_token_id or 0
        width_p = max(len(self.prompt_ids[i]) for i in indices)
        width_r = max(len(self.response_ids[i]) for i in indices)
        ids = torch.full((len(indices), width_p + width_r), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(indices):
            p, r = self.prompt_ids[i], self.response_ids[i]
            ids[row, width_p - len(p) : width_p + len(r)] = torch.tensor(p + r, dtype=torch.long)
            mask[row, width_p - len(p) : width_p + len(r)] = 1
        return Batch(
            {
                "input_ids": ids,
                "attention_mask": mask,
                "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
                "responses": ids[:, width_p:].clone(),
                "response_mask": mask[:, width_p:].clone(),
            }
        )

    def batches(
        self, batch_size: int, *, epoch: int, seed: int, shuffle: bool = True, start: int = 0
    ) -> Iterator[Batch]:
        """Whole batches of an epoch from batch number `start` (the data position)."""
        order = self.order(epoch, seed, shuffle)
        for b in range(start, len(order) // batch_size):
            yield self.collate(order[b * batch_size : (b + 1) * batch_size])
