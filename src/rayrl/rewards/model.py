"""ModelReward: a reward model (sequence-classification head, one label) scoring responses.

Loads a Hugging Face directory with `AutoModelForSequenceClassification` (num_labels=1)
and its tokenizer. Conversations (prompt messages + the response as the assistant
turn) are rendered with the tokenizer's chat template, tokenized, and scored in
micro-batches; the score of a sequence is the head's output at its last attended
token. That position comes from the attention mask, not from the pad token id, so left
or right padding, and pad ids that also occur inside the text, give the same scores.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rayrl.rewards.result import RewardResult, failed

Messages = list[dict[str, str]]


class ModelReward:
    """Score sequences with a sequence-classification reward model.

    Args:
        model_path: a Hugging Face model directory (loaded offline).
        device: torch device, e.g. "cpu" or "cuda:0".
        dtype: torch dtype or its name ("float32", "bfloat16", ...).
        micro_batch_size: sequences per forward pass.
        max_length: longer sequences keep only their last `max_length` tokens; None: all.
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = torch.float32,
        micro_batch_size: int = 8,
        max_length: int | None = None,
    ) -> None:
        if micro_batch_size < 1:
            raise ValueError(f"ModelReward: micro_batch_size={micro_batch_size} must be >= 1.")
        self.device = torch.device(device)
        self.dtype = _dtype(dtype)
        self.micro_batch_size, self.max_length = micro_batch_size, max_length
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            model_path, num_labels=1, dtype=self.dtype
        ).to(self.device)
        self.model.eval()
        self._head = _score_head(self.model, model_path)

    @torch.no_grad()  # type: ignore[untyped-decorator]  # torch is not followed
    def score_ids(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Scores (float32, shape [batch]) of padded token ids; padding on either side."""
        if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
            raise ValueError(
                f"score_ids needs 2-D input_ids and attention_mask of one shape; got "
                f"{tuple(input_ids.shape)} and {tuple(attention_mask.shape)}."
            )
        if not bool(attention_mask.any(dim=-1).all()):
            raise ValueError("score_ids: a sequence has no attended token (all padding).")
        out = []
        for start in range(0, input_ids.shape[0], self.micro_batch_size):
            ids = input_ids[start : start + self.micro_batch_size].to(self.device)
            mask = attention_mask[start : start + self.micro_batch_size].to(self.device)
            out.append(self._forward(ids, mask))
        return torch.cat(out).float().cpu()

    def score_texts(self, texts: list[str], add_special_tokens: bool = False) -> list[float]:
        """One score per text (texts already rendered, special tokens included)."""
        encoded = self.tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]
        return self._score_token_lists(encoded)

    def score_chats(self, prompts: list[Messages | str], responses: list[str]) -> list[float]:
        """One score per (prompt messages, response) pair, rendered with the chat template."""
        if len(prompts) != len(responses):
            raise ValueError(f"score_chats: {len(prompts)} prompts but {len(responses)} responses.")
        return self.score_texts(
            [self.render(p, r) for p, r in zip(prompts, responses, strict=True)]
        )

    def score(self, items: list[dict[str, Any]]) -> list[RewardResult]:
        """Score items with "prompt" (chat messages or text) and "solution_str"."""
        started = time.monotonic()
        scores = self.score_chats([i["prompt"] for i in items], [i["solution_str"] for i in items])
        each = (time.monotonic() - started) / max(1, len(items))
        return [
            RewardResult(score=s, elapsed_s=each)
            if math.isfinite(s)
            else failed(f"reward model returned a non-finite score ({s})", each)
            for s in scores
        ]

    def render(self, prompt: Messages | str, response: str) -> str:
        """The text of a conversation ending in `response` as the assistant turn."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        messages = [*messages, {"role": "assistant", "content": response}]
        text: str = self.tokenizer.apply_chat_template(messages, tokenize=False)
        return text

    def _score_token_lists(self, sequences: list[list[int]]) -> list[float]:
        if self.max_length is not None:
            sequences = [s[-self.max_length :] for s in sequences]
        scores: list[float] = []
        for start in range(0, len(sequences), self.micro_batch_size):
            chunk = sequences[start : start + self.micro_batch_size]
            width = max(len(s) for s in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros(len(chunk), width, dtype=torch.long)
            for row, seq in enumerate(chunk):
                ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
                mask[row, : len(seq)] = 1
            scores += self.score_ids(ids, mask).tolist()
        return scores

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Head output at each row's last attended token."""
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        hidden = self.model.base_model(
            input_ids=ids, attention_mask=mask, position_ids=positions
        ).last_hidden_state
        last = mask.shape[1] - 1 - mask.flip(-1).long().argmax(-1)
        pooled = hidden[torch.arange(ids.shape[0], device=ids.device), last]
        return self._head(pooled)[:, 0]


def _score_head(model: torch.nn.Module, where: Any) -> torch.nn.Module:
    """The linear head of a sequence-classification model ("score" or "classifier")."""
    for name in ("score", "classifier"):
        head = getattr(model, name, None)
        if isinstance(head, torch.nn.Linear):
            if head.out_features != 1:
                raise ValueError(f"{where}: reward head has {head.out_features} outputs; need 1.")
            return head
    raise ValueError(
        f"{where}: {type(model).__name__} has no linear 'score' or 'classifier' head; "
        "ModelReward supports decoder reward models such as *ForSequenceClassification "
        "of Llama/Qwen2/Mistral."
    )


def _dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A torch dtype from itself or its name ("float32", "bfloat16", "float16")."""
    resolved = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(resolved, torch.dtype):
        raise ValueError(
            f"ModelReward: dtype={dtype!r} is not a torch dtype; use e.g. 'float32' or 'bfloat16'."
        )
    return resolved
