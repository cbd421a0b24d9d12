"""Prompt datasets in verl's row format: Parquet (or JSON) in, left-padded prompt Batches out.

A row has `data_source`, `prompt` (chat messages), `ability`, `reward_model: {style,
ground_truth}` and `extra_info`, so verl's datasets work as they are. Rows that cannot
be used are not dropped silently, and never stop the run: each lands in
`PromptDataset.rejected` with its file, its row number in that file and the reason, and
the count is logged. A row is set aside when a column is missing, the prompt is not a
non-empty list of messages, a message has an unknown role (not system, user, assistant
or tool) or empty content, the ground truth is null, the chat template fails on it, or
its prompt is longer than `max_prompt_length` under `filter_overlong_prompts`.

Agent rows (multi-turn rollouts) keep verl's columns: `agent_name` (the environment of
the row's episodes, else the dataset's `default_agent`) is carried into the batch, and
`extra_info.tools_kwargs` with `extra_info`. Given the rollout's tool schemas (`tools`),
a row whose agent uses tools has them rendered into its prompt by the chat template
(`tools=`), as the model will see them; a `single_turn_agent` row has none.

Rows with images keep verl's layout too (`rayrl.data.prompt_images`): an image column
(`image_key`) and `<image>` placeholders in the prompt. Given a vision processor
(`rayrl.data.vision`), such a prompt's ids count each image's tokens, so
`max_prompt_length` does too; a row whose image does not decode is set aside like any
bad row, and one with images is never cut by `truncation=left|right` (its image tokens
must stay whole). The pixels are made per batch, not at load: each row of a collated
batch carries its own `multi_modal_inputs` (a dict of `pixel_values` and
`image_grid_thw` tensors, empty for a row without images), a non-tensor column, so rows
are split, gathered and repeated with their images and never concatenated across rows.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from rayrl.batch import Batch
from rayrl.data.errors import DataError
from rayrl.data.files import read_rows
from rayrl.data.prompt_images import PromptImages, RowImageError
from rayrl.data.vision import VisionProcessor
from rayrl.models.vision_language import IMAGE_COLUMN

log = logging.getLogger(__name__)
REQUIRED = ("data_source", "reward_model")
ROLES = ("system", "user", "assistant", "tool")
SINGLE_TURN_AGENTS = ("single_turn_agent", "single_turn")


def epoch_order(rows: int, epoch: int, seed: int, shuffle: bool = True) -> list[int]:
    """Row indices of an epoch: a permutation seeded by (seed, epoch) when shuffling."""
    indices = list(range(rows))
    if shuffle:
        random.Random(f"{seed}:{epoch}").shuffle(indices)
    return indices


def require_rows(data: Any, needed: int, key: str, what: str = "the dataset") -> None:
    """Raise DataError unless `data` (with `rejected` rows and `total_rows`) has at
    least `needed` usable rows (one batch of `key`)."""
    if len(data) >= needed:
        return
    aside = f"; {len(data.rejected)} set aside, first: {data.rejected[0]}" if data.rejected else ""
    raise DataError(
        f"{what} has {len(data)} usable rows (of {data.total_rows}{aside}), fewer "
        f"than one batch of {key}={needed}; add data or lower {key}"
    )


class EpochBatches:
    """An epoch of a dataset as whole batches (`order` and `collate` are the dataset's):
    the part of a dataset that the trainers' data loop reads."""

    def __len__(self) -> int:
        raise NotImplementedError

    def collate(self, indices: Sequence[int]) -> Batch:
        raise NotImplementedError

    def order(self, epoch: int, seed: int, shuffle: bool = True) -> list[int]:
        """The row order of an epoch: a permutation seeded by (seed, epoch) when shuffling."""
        return epoch_order(len(self), epoch, seed, shuffle)

    def batches(
        self, batch_size: int, *, epoch: int, seed: int, shuffle: bool = True, start: int = 0
    ) -> Iterator[Batch]:
        """Whole batches of an epoch from batch number `start` (the dataloader position)."""
        order = self.order(epoch, seed, shuffle)
        for b in range(start, len(order) // batch_size):
            yield self.collate(order[b * batch_size : (b + 1) * batch_size])


@dataclass(frozen=True)
class RowSource:
    """Where a row comes from: its file and its row number (from 0) in that file."""

    file: str
    row: int

    def __str__(self) -> str:
        return f"{self.file} row {self.row}"


@dataclass(frozen=True)
class RejectedRow:
    """A row that was set aside: its position in the input, where it came from, and why."""

    index: int
    reason: str
    source: RowSource | None = None

    def __str__(self) -> str:
        return f"{self.source or f'row {self.index}'}: {self.reason}"


def read_rows_with_sources(
    files: str | Path | Sequence[str | Path],
) -> tuple[list[dict[str, Any]], list[RowSource]]:
    """All rows of one or more data files (Parquet, or JSON by extension:
    `rayrl.data.files`), in order, and where each comes from."""
    paths = [files] if isinstance(files, str | Path) else list(files)
    rows: list[dict[str, Any]] = []
    sources: list[RowSource] = []
    for path in paths:
        table = read_rows(path)
        rows.extend(table)
        sources.extend(RowSource(str(path), i) for i in range(len(table)))
    return rows, sources


def read_parquet(files: str | Path | Sequence[str | Path]) -> list[dict[str, Any]]:
    """All rows of one or more data files, in order."""
    return read_rows_with_sources(files)[0]


def write_parquet(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
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
    problem = messages_problem(row[prompt_key], prompt_key)
    if problem:
        return problem
    reward = row["reward_model"]
    if not isinstance(reward, dict) or "ground_truth" not in reward:
        return "reward_model must be a mapping with a ground_truth"
    if reward["ground_truth"] is None:
        return "reward_model.ground_truth is null (nothing to score against)"
    return None


def messages_problem(messages: object, prompt_key: str) -> str | None:
    if not isinstance(messages, list | tuple) or not all(
        isinstance(m, dict) and "role" in m and "content" in m for m in messages
    ):
        return f"'{prompt_key}' must be a list of {{role, content}} messages"
    if not messages:
        return f"'{prompt_key}' has no messages"
    for i, message in enumerate(messages):
        if message["role"] not in ROLES:
            return (
                f"'{prompt_key}' message {i} has role {message['role']!r} "
                f"(expected one of {', '.join(ROLES)})"
            )
        content = message["content"]
        if not isinstance(content, str) or not content.strip():
            return f"'{prompt_key}' message {i} ({message['role']}) has empty content"
    return None


class PromptDataset(EpochBatches):
    """Tokenized prompts (chat template applied, with `chat_template_kwargs`: verl's
    `data.apply_chat_template_kwargs`) with over-long and malformed rows set aside;
    with `vision`, prompts with images (`image_key`, `video_key`: verl's
    `data.image_key`, `data.video_key`)."""

    def __init__(
        self,
        rows: Sequence[dict[str, Any]],
        tokenizer: Any,
        *,
        max_prompt_length: int,
        truncation: str = "error",
        filter_overlong: bool = True,
        prompt_key: str = "prompt",
        sources: Sequence[RowSource] | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
        default_agent: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        vision: VisionProcessor | None = None,
        image_key: str = "images",
        video_key: str = "videos",
    ) -> None:
        self.tokenizer = tokenizer
        self.media = PromptImages(vision, image_key, video_key)
        # kept row -> (its rendered prompt, its data file's folder, where it came from)
        self.image_prompts: dict[int, tuple[str, Path, str]] = {}
        self.sampler = None  # a sampler of one's own orders the epochs (`rayrl.data.sampler`)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.prompt_key = prompt_key
        self.max_prompt_length = max_prompt_length
        self.tools = list(tools) if tools else None
        self.default_agent = default_agent
        self.rows: list[dict[str, Any]] = []
        self.prompt_ids: list[list[int]] = []
        self.positions: list[int] = []  # index of each kept row in the input
        self.rejected: list[RejectedRow] = []
        self.truncated = 0  # prompts cut to max_prompt_length (data.truncation=left|right)
        self.total_rows = len(rows)
        for i, row in enumerate(rows):
            source = sources[i] if sources is not None else None
            base = Path(source.file).parent if source else Path.cwd()
            problem = _row_problem(row, prompt_key) or self.media.problem(row, prompt_key)
            ids, text = None, None
            if not problem:
                ids, text, problem = self._encode_row(row, base)
            if ids is not None and len(ids) > max_prompt_length:
                ids, problem = self._fit(
                    ids, truncation, filter_overlong, source or f"row {i}", text is not None
                )
            if problem:
                self.rejected.append(RejectedRow(i, problem, source))
                continue
            if ids is None:  # _encode_row gives ids or a reason, never neither
                raise RuntimeError(f"row {i}: no token ids and no reason why (a bug in rayrl)")
            if text is not None:
                self.image_prompts[len(self.rows)] = (text, base, str(source or f"row {i}"))
            self.rows.append(row)
            self.prompt_ids.append(ids)
            self.positions.append(i)
        self.uids = [f"p{i}" for i in self.positions]  # stable prompt ids (seed sampling)
        if self.rejected:
            log.info(
                "%d of %d rows set aside (first: %s); each is in .rejected",
                len(self.rejected),
                len(rows),
                self.rejected[0],
            )

    def agent_of(self, row: dict[str, Any]) -> str | None:
        """The row's environment: its `agent_name` column (or `extra_info.agent_name`,
        as `rayrl.envs.episode_fields` reads it), else the dataset's default."""
        extra = row.get("extra_info")
        named = row.get("agent_name") or (
            extra.get("agent_name") if isinstance(extra, dict) else None
        )
        return str(named) if named else self.default_agent

    def _tools_of(self, row: dict[str, Any]) -> list[dict[str, Any]] | None:
        """The tool schemas the row's prompt shows (none for a single-turn agent)."""
        if not self.tools or self.agent_of(row) in SINGLE_TURN_AGENTS:
            return None
        return self.tools

    def _encode_row(
        self, row: dict[str, Any], base: Path
    ) -> tuple[list[int] | None, str | None, str | None]:
        """(token ids, the rendered prompt when it has images, why there are no ids)."""
        if not self.media.entries(row):
            ids, problem = self._encode(row[self.prompt_key], self._tools_of(row))
            return ids, None, problem
        messages = self.media.messages(row[self.prompt_key])
        text, problem = self._render(messages, self._tools_of(row))
        if text is None:
            return None, None, problem
        try:
            return self.media.encode(text, row, base), text, None
        except RowImageError as err:
            return None, None, str(err)

    def _encode(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> tuple[list[int] | None, str | None]:
        """Token ids of the prompt with the chat template applied, or why there are none."""
        text, problem = self._render(messages, tools)
        if text is None:
            return None, problem
        return self.tokenizer(text, add_special_tokens=False)["input_ids"], None

    def _render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> tuple[str | None, str | None]:
        """The prompt's text with the chat template applied, or why there is none."""
        extra = dict(self.chat_template_kwargs)
        if tools:
            extra["tools"] = tools
        try:
            text = self.tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=True, **extra
            )
        except Exception as exc:  # noqa: BLE001 - a template's own error, kept as the reason
            return None, f"the chat template failed: {type(exc).__name__}: {exc}"
        return text, None

    @classmethod
    def tokenized(
        cls,
        rows: list[dict[str, Any]],
        prompt_ids: list[list[int]],
        uids: list[str],
        tokenizer: Any,
    ) -> PromptDataset:
        """A dataset of rows tokenised elsewhere (e.g. by Ray Data tasks), ready to collate."""
        self = cls.__new__(cls)
        self.tokenizer, self.rows, self.prompt_ids, self.uids = tokenizer, rows, prompt_ids, uids
        self.tools, self.default_agent = None, None
        self.media, self.image_prompts = PromptImages(), {}
        self.positions, self.rejected, self.truncated = list(range(len(rows))), [], 0
        self.max_prompt_length = max((len(p) for p in prompt_ids), default=0)
        return self

    def require_rows(self, needed: int, key: str = "data.train_batch_size") -> None:
        """Raise DataError unless at least `needed` rows are usable (one batch)."""
        require_rows(self, needed, key)

    def _fit(
        self,
        ids: list[int],
        truncation: str,
        filter_overlong: bool,
        where: object,
        images: bool = False,
    ) -> tuple[list[int], str | None]:
        if images:
            return self._fit_images(ids, truncation, filter_overlong, where)
        limit = self.max_prompt_length
        if truncation in ("left", "right"):
            self.truncated += 1
            return (ids[-limit:] if truncation == "left" else ids[:limit]), None
        reason = f"prompt of {len(ids)} tokens is over data.max_prompt_length={limit}"
        if filter_overlong:
            return ids, reason
        raise DataError(
            f"{where}: {reason}; raise max_prompt_length, set data.truncation=left|right, "
            "or data.filter_overlong_prompts=true to set such rows aside"
        )

    def _fit_images(
        self, ids: list[int], truncation: str, filter_overlong: bool, where: object
    ) -> tuple[list[int], str | None]:
        """An over-long prompt with images: set aside, never cut (its image tokens must
        stay whole), or an error under truncation=error without the filter."""
        count = self.media.image_tokens(ids)
        reason = (
            f"prompt of {len(ids)} tokens ({count} of them for its images) is over "
            f"data.max_prompt_length={self.max_prompt_length}"
        )
        if truncation in ("left", "right"):
            return (
                ids,
                f"{reason}; a prompt with images is not cut (its image tokens must stay whole)",
            )
        if filter_overlong:
            return ids, reason
        raise DataError(
            f"{where}: {reason}; raise max_prompt_length, lower the images' max_pixels, or "
            "set data.filter_overlong_prompts=true to set such rows aside"
        )

    def __len__(self) -> int:
        return len(self.rows)

    def order(self, epoch: int, seed: int, shuffle: bool = True) -> list[int]:
        """The row order of an epoch: the configured sampler's (`rayrl.data.sampler`), else
        a permutation seeded by (seed, epoch) when shuffling."""
        if self.sampler is not None:
            from rayrl.data.sampler import sampler_order

            return sampler_order(self.sampler, len(self), seed, epoch)
        return epoch_order(len(self), epoch, seed, shuffle)

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

        def column(fn: Callable[[int], object]) -> np.ndarray:
            out = np.empty(len(indices), dtype=object)
            out[:] = [fn(i) for i in indices]
            return out

        non_tensors = {
            "uid": column(lambda i: self.uids[i]),
            "data_source": column(lambda i: self.rows[i]["data_source"]),
            "ground_truth": column(lambda i: self.rows[i]["reward_model"]["ground_truth"]),
            "extra_info": column(lambda i: self.rows[i].get("extra_info") or {}),
            "raw_prompt": column(lambda i: self.rows[i][getattr(self, "prompt_key", "prompt")]),
        }
        if self.default_agent or any(r.get("agent_name") for r in self.rows):
            non_tensors["agent_name"] = column(lambda i: self.agent_of(self.rows[i]))
        if self.media.vision is not None:
            non_tensors[IMAGE_COLUMN] = column(self.multi_modal_inputs)
        return Batch(
            tensors={"input_ids": ids, "attention_mask": mask, "position_ids": position_ids},
            non_tensors=non_tensors,
        )

    def multi_modal_inputs(self, index: int) -> dict[str, torch.Tensor]:
        """Row `index`'s pixel inputs (empty without images), made from its images now; a
        DataError names the row when they no longer give the ids it was loaded with."""
        if index not in self.image_prompts:
            return {}
        text, base, where = self.image_prompts[index]
        return self.media.pixel_inputs(text, self.rows[index], base, self.prompt_ids[index], where)
