"""Supervised fine-tuning data: (prompt, response) rows in, Batches the engine trains on.

Rows come from parquet files with verl's SFT columns: `data.prompt_key` holds the
prompt, either a string (one user turn) or a list of chat messages, and
`data.response_key` the response string; `prompt_dict_keys` / `response_dict_keys`
reach into nested columns (verl's GSM8K: `prompt_key=extra_info`,
`prompt_dict_keys=[question]`). The prompt goes through the chat template with the
generation prompt (as `rayrl train` renders prompts), the response is followed by the
tokenizer's end-of-sequence token (so the model learns to stop), and the two are
tokenized apart, as they are when a policy generates.

Multi-turn rows (`multiturn=True`, verl's `data.multiturn`): the `messages_key` column
holds a whole conversation (system, user, assistant and tool messages; tool schemas in
the `tools_key` column go to the chat template) and the loss covers the assistant
messages only, each up to its end-of-turn token: the conversation is rendered one
message at a time (every render must extend the previous one), each piece tokenised on
its own and the pieces concatenated, as a multi-turn rollout lays out its tokens. The
prompt is everything before the first assistant message.

A collated batch has the layout of a rollout: left-padded prompt, right-padded
response, `responses` and `response_mask`; the engine computes log-probs over the
response columns only, so the loss covers response tokens where `response_mask` is 1
and nothing else.

Rows with images (a vision-language model's SFT, `vision` its image processor) keep
verl's layout, as `rayrl train`'s prompts do (`rayrl.data.prompt_images`): an image
column (`image_key`) and an `<image>` placeholder in the prompt's text per image. The
prompt's ids count each image's tokens, and a collated batch carries each row's
`multi_modal_inputs` (its `pixel_values` and `image_grid_thw`, empty for a row without
images), which the training engine splices into the prompt's image tokens
(`rayrl.train.vision_inputs`), as for the actor's passes. Such a prompt is never cut
(its image tokens must stay whole); multi-turn rows with images are set aside (not read
yet).

Rows that cannot be used are set aside with their file, row number and reason (a
missing key, an empty prompt or response, malformed messages, a response truncation
leaves empty); a row longer than `data.max_length` is cut (`truncation=left|right`) or
stops the load with its file and row (`error`, verl's default).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rayrl.batch import Batch
from rayrl.data.dataset import (
    EpochBatches,
    RejectedRow,
    RowSource,
    messages_problem,
    require_rows,
)
from rayrl.data.errors import DataError
from rayrl.data.prompt_images import PromptImages, RowImageError
from rayrl.data.vision import VisionProcessor
from rayrl.models.vision_language import IMAGE_COLUMN

log = logging.getLogger(__name__)

# A row's token lists: (prompt ids, response ids, response mask).
TokenRow = tuple[list[int], list[int], list[int]]


def row_field(row: Any, key: str, nested: Sequence[str]) -> tuple[Any, str | None]:
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


def prompt_messages(prompt: Any, key: str) -> tuple[list[dict[str, Any]] | None, str | None]:
    if isinstance(prompt, str):
        if not prompt.strip():
            return None, f"'{key}' is an empty string"
        return [{"role": "user", "content": prompt}], None
    messages = list(prompt) if isinstance(prompt, list | tuple | np.ndarray) else prompt
    problem = messages_problem(messages, key)
    return (None, problem) if problem else (messages, None)


def _turn_mask(ids: list[int], special: set[int]) -> list[int]:
    """1 on an assistant message's tokens up to its last special token (its end of turn;
    what the template adds after it, such as a newline, is not the model's to write)."""
    last = max((k for k, t in enumerate(ids) if t in special), default=len(ids) - 1)
    return [1] * (last + 1) + [0] * (len(ids) - last - 1)


class SFTDataset(EpochBatches):
    """Tokenized (prompt, response) pairs; unusable rows set aside in `rejected`."""

    def __init__(
        self,
        rows: Sequence[dict[str, Any]],
        tokenizer: Any,
        *,
        prompt_key: str = "question",
        response_key: str = "answer",
        prompt_dict_keys: Sequence[str] = (),
        response_dict_keys: Sequence[str] = (),
        max_length: int = 1024,
        truncation: str = "error",
        chat_template_kwargs: dict[str, Any] | None = None,
        sources: Sequence[RowSource] | None = None,
        multiturn: bool = False,
        messages_key: str = "messages",
        tools_key: str = "tools",
        vision: VisionProcessor | None = None,
        image_key: str = "images",
    ) -> None:
        self.tokenizer = tokenizer
        self.media = PromptImages(vision, image_key)
        # kept row -> (its rendered prompt, the row, its file's folder, where it came from)
        self.image_prompts: dict[int, tuple[str, dict[str, Any], Path, str]] = {}
        self.max_length, self.truncation = max_length, truncation
        self.keys = (prompt_key, tuple(prompt_dict_keys), response_key, tuple(response_dict_keys))
        self.multiturn, self.messages_key, self.tools_key = multiturn, messages_key, tools_key
        self.template_kwargs = dict(chat_template_kwargs or {})
        self.prompt_ids: list[list[int]] = []
        self.response_ids: list[list[int]] = []
        self.response_masks: list[list[int]] = []  # 1: trained (assistant tokens)
        self.rejected: list[RejectedRow] = []
        self.total_rows = len(rows)
        encode = self._encode_conversation if multiturn else self._encode_pair
        for i, row in enumerate(rows):
            source = sources[i] if sources is not None else None
            base = Path(source.file).parent if source else Path.cwd()
            triple, problem, text = encode(row, base)
            if triple is not None:
                triple, problem = self._fit(*triple, source or f"row {i}", text is not None)
            if problem:
                self.rejected.append(RejectedRow(i, problem, source))
                continue
            if triple is None:  # the encoders give token lists or a reason, never neither
                raise RuntimeError(f"row {i}: no token ids and no reason why (a bug in rayrl)")
            if text is not None:
                self.image_prompts[len(self)] = (text, row, base, str(source or f"row {i}"))
            self.prompt_ids.append(triple[0])
            self.response_ids.append(triple[1])
            self.response_masks.append(triple[2])
        if self.rejected:
            log.info(
                "%d of %d SFT rows set aside (first: %s); each is in .rejected",
                len(self.rejected),
                len(rows),
                self.rejected[0],
            )

    def _encode_pair(self, row: Any, base: Path) -> tuple[TokenRow | None, str | None, str | None]:
        """((prompt ids, response ids, response mask), why there are none, the rendered
        prompt when it has images)."""
        prompt_key, prompt_nested, response_key, response_nested = self.keys
        prompt, problem = row_field(row, prompt_key, prompt_nested)
        if problem:
            return None, problem, None
        response, problem = row_field(row, response_key, response_nested)
        if problem:
            return None, problem, None
        if not isinstance(response, str) or not response.strip():
            return None, f"'{response_key}' must be a non-empty string, got {response!r}", None
        messages, problem = prompt_messages(prompt, prompt_key)
        if messages is None:
            return None, problem, None
        images = {**row, prompt_key: messages}  # the placeholders are counted in the messages
        problem = self.media.problem(images, prompt_key)
        if problem:
            return None, problem, None
        with_images = bool(self.media.entries(row))
        if with_images:
            messages = self.media.messages(messages)
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **self.template_kwargs
            )
        except Exception as exc:  # noqa: BLE001 - a template's own error, kept as the reason
            return None, f"the chat template failed: {type(exc).__name__}: {exc}", None
        eos = self.tokenizer.eos_token or ""
        encode = self.tokenizer
        if with_images:
            try:
                prompt_ids = self.media.encode(text, row, base)
            except RowImageError as err:
                return None, str(err), None
        else:
            prompt_ids = encode(text, add_special_tokens=False)["input_ids"]
        response_ids = encode(response + eos, add_special_tokens=False)["input_ids"]
        triple = (prompt_ids, response_ids, [1] * len(response_ids))
        return triple, None, text if with_images else None

    def _encode_conversation(
        self, row: Any, base: Path
    ) -> tuple[TokenRow | None, str | None, str | None]:
        """(prompt ids, response ids, response mask) of a multi-turn row (module doc)."""
        triple, problem = self._conversation(row)
        return triple, problem, None

    def _conversation(self, row: Any) -> tuple[TokenRow | None, str | None]:
        messages, problem = row_field(row, self.messages_key, ())
        if problem:
            return None, problem
        if isinstance(row, dict) and self.media.entries(row):
            return None, (
                f"the row has images in column '{self.media.image_key}': multi-turn SFT "
                "reads no images yet; drop them or train single-turn rows"
            )
        messages, problem = prompt_messages(messages, self.messages_key)
        if messages is None:
            return None, problem
        roles = [m["role"] for m in messages]
        if "assistant" not in roles or roles.index("assistant") == 0:
            return None, f"'{self.messages_key}' has no assistant message after a prompt"
        tools = row.get(self.tools_key) if isinstance(row, dict) else None
        try:
            pieces = self._pieces(list(messages), list(tools) if tools else None)
        except Exception as exc:  # noqa: BLE001 - a template's own error, kept as the reason
            return None, f"the chat template failed: {type(exc).__name__}: {exc}"
        if isinstance(pieces, str):
            return None, pieces
        encode = self.tokenizer
        prompt_ids = encode(pieces[0][0], add_special_tokens=False)["input_ids"]
        response, mask = [], []
        for text, trained in pieces[1:]:
            ids = encode(text, add_special_tokens=False)["input_ids"]
            response += ids
            mask += (
                _turn_mask(ids, set(self.tokenizer.all_special_ids)) if trained else [0] * len(ids)
            )
        return (prompt_ids, response, mask), None

    def _pieces(
        self, messages: list[dict[str, Any]], tools: list[Any] | None
    ) -> list[tuple[str, bool]] | str:
        """The conversation's text in pieces (text, is an assistant message): the prompt
        first; or why the template cannot render it message by message."""
        kwargs = {**self.template_kwargs, **({"tools": tools} if tools else {})}

        def render(upto: int, generation: bool) -> str:
            text: str = self.tokenizer.apply_chat_template(
                messages[:upto], tokenize=False, add_generation_prompt=generation, **kwargs
            )
            return text

        first = [m["role"] for m in messages].index("assistant")
        done = render(first, True)
        pieces = [(done, False)]
        for k in range(first, len(messages)):
            trained = messages[k]["role"] == "assistant"
            steps = [(render(k, True), False)] if trained else []
            for text, piece_trained in [*steps, (render(k + 1, False), trained)]:
                if not text.startswith(done):
                    return (
                        f"the chat template does not render message {k} "
                        f"({messages[k]['role']}) as a continuation of the messages before "
                        "it; multi-turn SFT needs a template that renders turn by turn"
                    )
                if len(text) > len(done):
                    pieces.append((text[len(done) :], piece_trained))
                done = text
        return pieces

    def _fit(
        self,
        prompt: list[int],
        response: list[int],
        mask: list[int],
        where: object,
        images: bool = False,
    ) -> tuple[TokenRow | None, str | None]:
        """Apply `data.truncation` to a row over `max_length` tokens (the mask with it); a
        prompt with `images` is never cut (a row that would be is set aside)."""
        limit, total = self.max_length, len(prompt) + len(response)
        if total <= limit:
            return (prompt, response, mask), None
        if self.truncation == "error":
            raise DataError(
                f"{where}: prompt {len(prompt)} + response {len(response)} = {total} tokens is "
                f"over data.max_length={limit}; raise data.max_length or set "
                "data.truncation=left (drop the start) or right (drop the end)"
            )
        if images and (self.truncation == "left" or len(prompt) >= limit):
            return None, (
                f"prompt {len(prompt)} + response {len(response)} = {total} tokens is over "
                f"data.max_length={limit}, and a prompt with images is not cut (its image "
                "tokens must stay whole)"
            )
        if self.truncation == "left":  # the prompt's start goes first, then the response's
            cut = total - limit
            if cut < len(prompt):
                return (prompt[cut:], response, mask), None
            keep = cut - len(prompt)
            return ([], response[keep:], mask[keep:]), None
        if len(prompt) >= limit:
            return None, f"the prompt alone ({len(prompt)} tokens) fills data.max_length={limit}"
        keep = limit - len(prompt)
        return (prompt, response[:keep], mask[:keep]), None

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def require_rows(self, needed: int, key: str = "data.train_batch_size") -> None:
        """Raise DataError unless at least `needed` rows are usable (one batch)."""
        require_rows(self, needed, key, what="the SFT data")

    def collate(self, indices: Sequence[int]) -> Batch:
        """Left-padded prompts, right-padded responses: `input_ids`, `attention_mask`,
        `position_ids` over both, and `responses`, `response_mask` over the responses;
        with an image processor, each row's `multi_modal_inputs` too."""
        batch = collate_rows(
            [self.prompt_ids[i] for i in indices],
            [self.response_ids[i] for i in indices],
            [self.response_masks[i] for i in indices],
            pad_id(self.tokenizer),
        )
        if self.media.vision is not None:
            column = np.empty(len(indices), dtype=object)
            column[:] = [self.multi_modal_inputs(i) for i in indices]
            batch[IMAGE_COLUMN] = column
        return batch

    def multi_modal_inputs(self, index: int) -> dict[str, torch.Tensor]:
        """Row `index`'s pixel inputs (empty without images), made from its images now."""
        if index not in self.image_prompts:
            return {}
        text, row, base, where = self.image_prompts[index]
        return self.media.pixel_inputs(text, row, base, self.prompt_ids[index], where)


def pad_id(tokenizer: Any) -> int:
    """The id padding is written with: the pad token's, else end-of-sequence's, else 0."""
    pad = tokenizer.pad_token_id
    return pad if pad is not None else tokenizer.eos_token_id or 0


def collate_rows(
    prompts: Sequence[list[int]],
    responses: Sequence[list[int]],
    response_masks: Sequence[list[int]],
    pad: int,
) -> Batch:
    """A rollout-layout Batch of token rows: left-padded prompts, right-padded responses
    (`input_ids`, `attention_mask`, `position_ids` over both; `responses` and
    `response_mask` over the responses)."""
    width_p = max(len(p) for p in prompts)
    width_r = max(len(r) for r in responses)
    ids = torch.full((len(prompts), width_p + width_r), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    trained = torch.zeros((len(prompts), width_r), dtype=torch.long)
    for row, (p, r, m) in enumerate(zip(prompts, responses, response_masks, strict=True)):
        ids[row, width_p - len(p) : width_p + len(r)] = torch.tensor(p + r, dtype=torch.long)
        mask[row, width_p - len(p) : width_p + len(r)] = 1
        trained[row, : len(r)] = torch.tensor(m, dtype=torch.long)
    return Batch(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "responses": ids[:, width_p:].clone(),
            "response_mask": trained,
        }
    )
