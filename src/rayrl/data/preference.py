"""Preference pairs: (prompt, chosen, rejected) rows in, Batches of pairs out.

Rows come from parquet files with verl's reward-model columns, which are OpenRLHF's
defaults too: `prompt`, `chosen`, `rejected` (`data.prompt_key`, `data.chosen_key`,
`data.rejected_key`). Left at their defaults, each key also takes the common variants
of other datasets (`PROMPT_VARIANTS`, `CHOSEN_VARIANTS`, `REJECTED_VARIANTS`: the
first one a row has). The prompt is a string (one user turn) or a list of chat
messages; a response is a string, or a conversation ending in the assistant's message
(OpenRLHF's and HH-RLHF's layout, the prompt inside it): the response is that last
message and, when the row has no prompt column, the prompt is the messages before it.

Two encodings, one per kind of model trained:

* ``policy`` (`rayrl dpo`): the prompt through the chat template with the generation
  prompt, the response followed by the end-of-sequence token, tokenized apart: the
  layout of `rayrl sft` and of a rollout, so the engine's log-probs cover exactly the
  response tokens;
* ``score`` (`rayrl rm`): the whole conversation rendered by the chat template with the
  response as the assistant's turn and tokenized in one piece, as
  `rayrl.rewards.model.ModelReward` renders what it scores in `rayrl train`; it sits in
  the prompt columns and the response is one placeholder token, so the engine's value
  head output at that token (`values[:, 0]`) is the head's output at the
  conversation's last token: the reward model's score.

A collated batch of `n` pairs has `2n` rows, each pair's chosen row then its rejected
row (`pair_role` 1 and 0), in `rayrl.data.sft.collate_rows`' layout. Rows that cannot
be used are set aside with their file, row number and reason; a pair longer than
`data.max_length` is cut (`truncation=left`: the prompt's start, for a scored pair the
conversation's start; `right`: the response's end) or stops the load (`error`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from rayrl.batch import Batch
from rayrl.data.dataset import EpochBatches, RejectedRow, RowSource, require_rows
from rayrl.data.errors import DataError
from rayrl.data.sft import collate_rows, pad_id, prompt_messages

log = logging.getLogger(__name__)

ENCODINGS = ("policy", "score")
DEFAULT_KEYS = ("prompt", "chosen", "rejected")
PROMPT_VARIANTS = ("prompt", "question", "instruction", "input", "context")
CHOSEN_VARIANTS = ("chosen", "chosen_response", "response_chosen", "positive", "pos")
REJECTED_VARIANTS = ("rejected", "rejected_response", "response_rejected", "negative", "neg")


def _column(
    row: dict[str, Any], key: str, default: str, variants: Sequence[str]
) -> tuple[Any, str]:
    """(value, column) of `key`, or at the default key of its first variant present."""
    if key in row and row[key] is not None:
        return row[key], key
    if key == default:
        for name in variants:
            if row.get(name) is not None:
                return row[name], name
    return None, key


def _response(value: Any, key: str) -> tuple[str | None, list[dict[str, Any]] | None, str | None]:
    """(response text, the messages before it when `value` is a conversation, problem)."""
    if isinstance(value, str):
        if not value.strip():
            return None, None, f"'{key}' is an empty string"
        return value, None, None
    if isinstance(value, list | tuple | np.ndarray) and len(value):
        messages = [dict(m) if isinstance(m, dict) else m for m in value]
        last = messages[-1]
        if not isinstance(last, dict) or last.get("role") != "assistant":
            return (
                None,
                None,
                f"'{key}' is a conversation that does not end in an assistant message",
            )
        content = last.get("content")
        if not isinstance(content, str) or not content.strip():
            return None, None, f"'{key}' ends in an empty assistant message"
        return content, messages[:-1], None
    return None, None, f"'{key}' must be a string or a list of chat messages, got {value!r}"


class PairDataset(EpochBatches):
    """Tokenized preference pairs (module docstring); unusable rows in `rejected`."""

    def __init__(
        self,
        rows: Sequence[dict[str, Any]],
        tokenizer: Any,
        *,
        encoding: str = "policy",
        prompt_key: str = "prompt",
        chosen_key: str = "chosen",
        rejected_key: str = "rejected",
        max_length: int = 1024,
        truncation: str = "error",
        chat_template_kwargs: dict[str, Any] | None = None,
        sources: Sequence[RowSource] | None = None,
    ) -> None:
        if encoding not in ENCODINGS:
            raise ValueError(f"encoding={encoding!r} is not one of {ENCODINGS}")
        self.tokenizer, self.encoding = tokenizer, encoding
        self.keys = (prompt_key, chosen_key, rejected_key)
        self.max_length, self.truncation = max_length, truncation
        self.template_kwargs = dict(chat_template_kwargs or {})
        # per pair: (prompt ids, response ids) of the chosen then the rejected response
        self.pairs: list[tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]]] = []
        self.rejected: list[RejectedRow] = []
        self.total_rows = len(rows)
        for i, row in enumerate(rows):
            source = sources[i] if sources is not None else None
            pair, problem = self._encode(row, source or f"row {i}")
            if problem:
                self.rejected.append(RejectedRow(i, problem, source))
            else:
                self.pairs.append(pair)
        if self.rejected:
            log.info(
                "%d of %d preference rows set aside (first: %s); each is in .rejected",
                len(self.rejected),
                len(rows),
                self.rejected[0],
            )

    def _encode(self, row: Any, where: object) -> tuple[Any, str | None]:
        if not isinstance(row, dict):
            return None, f"a row must be a mapping, got {type(row).__name__}"
        prompt_key, chosen_key, rejected_key = self.keys
        responses = []
        for key, default, variants in (
            (chosen_key, "chosen", CHOSEN_VARIANTS),
            (rejected_key, "rejected", REJECTED_VARIANTS),
        ):
            value, column = _column(row, key, default, variants)
            if value is None:
                return None, f"missing column '{key}'"
            text, before, problem = _response(value, column)
            if problem:
                return None, problem
            responses.append((text, before))
        prompt, column = _column(row, prompt_key, "prompt", PROMPT_VARIANTS)
        if prompt is None:
            prompt = responses[0][1]  # a conversation's messages before the response
            if not prompt:
                return None, f"missing column '{prompt_key}'"
        messages, problem = prompt_messages(prompt, column)
        if problem or messages is None:
            return None, problem
        encoded = []
        try:
            for text, _ in responses:
                encoded.append(self._tokens(messages, str(text), where))
        except DataError:
            raise
        except Exception as exc:  # noqa: BLE001 - a template's own error, kept as the reason
            return None, f"the chat template failed: {type(exc).__name__}: {exc}"
        for tokens in encoded:
            if isinstance(tokens, str):
                return None, tokens
        return tuple(encoded), None

    def _tokens(
        self, messages: list[dict[str, Any]], response: str, where: object
    ) -> tuple[list[int], list[int]] | str:
        """(prompt ids, response ids) of one response, cut to `max_length`; or why not."""
        encode = self.tokenizer
        if self.encoding == "score":
            text = self.tokenizer.apply_chat_template(
                [*messages, {"role": "assistant", "content": response}],
                tokenize=False,
                **self.template_kwargs,
            )
            ids = encode(text, add_special_tokens=False)["input_ids"]
            if len(ids) > self.max_length:
                ids = self._cut_scored(ids, where)
            return ids, [pad_id(self.tokenizer)]  # the placeholder the score is read at
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **self.template_kwargs
        )
        prompt = encode(text, add_special_tokens=False)["input_ids"]
        reply = encode(response + (self.tokenizer.eos_token or ""), add_special_tokens=False)
        return self._fit(prompt, reply["input_ids"], where)

    def _too_long(self, total: int, where: object) -> DataError:
        return DataError(
            f"{where}: {total} tokens is over data.max_length={self.max_length}; raise "
            "data.max_length or set data.truncation=left (drop the start) or right (drop "
            "the end)"
        )

    def _cut_scored(self, ids: list[int], where: object) -> list[int]:
        if self.truncation == "error":
            raise self._too_long(len(ids), where)
        keep = self.max_length
        return ids[-keep:] if self.truncation == "left" else ids[:keep]

    def _fit(
        self, prompt: list[int], response: list[int], where: object
    ) -> tuple[list[int], list[int]] | str:
        limit, total = self.max_length, len(prompt) + len(response)
        if total <= limit:
            return prompt, response
        if self.truncation == "error":
            raise self._too_long(total, where)
        if self.truncation == "left":
            cut = total - limit
            if cut >= len(prompt):
                return f"the response alone ({len(response)} tokens) fills data.max_length"
            return prompt[cut:], response
        if len(prompt) >= limit:
            return f"the prompt alone ({len(prompt)} tokens) fills data.max_length={limit}"
        return prompt, response[: limit - len(prompt)]

    def __len__(self) -> int:
        return len(self.pairs)

    def require_rows(self, needed: int, key: str = "data.train_batch_size") -> None:
        """Raise DataError unless at least `needed` pairs are usable (one batch)."""
        require_rows(self, needed, key, what="the preference pairs")

    def collate(self, indices: Sequence[int]) -> Batch:
        """`2 x len(indices)` rows: each pair's chosen row, then its rejected row
        (`pair_role` 1 and 0); a scored pair's `response_mask` is its placeholder."""
        rows = [side for i in indices for side in self.pairs[i]]
        batch = collate_rows(
            [p for p, _ in rows],
            [r for _, r in rows],
            [[1] * len(r) for _, r in rows],
            pad_id(self.tokenizer),
        )
        batch["pair_role"] = torch.tensor([1, 0] * len(indices), dtype=torch.long)
        return batch
