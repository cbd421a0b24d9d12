"""The Batch contract of rollout engines: what `generate` takes and what it returns.

Input (verl's convention), B prompts left-padded to length P:

- tensors ``input_ids`` [B, P], ``attention_mask`` [B, P], ``position_ids`` [B, P]
  (computed from the mask when absent);
- non-tensor ``uid``: one id per prompt; meta ``step``: the training step (int).

Output, B*n rows, each prompt's n samples adjacent (sample k of prompt ``uid`` has
``sample_uid`` ``f"{uid}/{k}"``), responses right-padded to R = max_new_tokens:

- ``prompts`` [B*n, P], ``responses`` [B*n, R] (pad id after the end),
  ``response_mask`` [B*n, R], ``input_ids`` [B*n, P+R] (prompt + response),
  ``attention_mask`` and ``position_ids`` over P+R, ``rollout_log_probs`` [B*n, R]
  (float32, 0 on padding);
- ``routed_experts`` [B*n, P+R, layers, k] where the engine recorded each token's
  experts (a mixture of experts, `rayrl.algos.routing`): aligned with ``input_ids``,
  unrouted on padding and where nothing was recorded;
- non-tensor ``finish_reason`` ("stop" | "length") and ``sample_uid``;
- every other column of the prompt batch, repeated for each sample; meta as given.

Every engine starts from `sample_rows` (its input checked with `check_prompts`, each
prompt's rows and sample uids from `expand_samples`, the samples' keys) and builds its
output with `assemble_output`, so all engines agree on the format and the seeds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from rayrl.algos.routing import ROUTES, unrouted
from rayrl.batch import Batch
from rayrl.rollout.sampling import sample_keys

__all__ = [
    "FINISH_LENGTH",
    "FINISH_STOP",
    "Responses",
    "SampleRows",
    "assemble_output",
    "check_prompts",
    "expand_samples",
    "positions_from_mask",
    "sample_rows",
]

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
_REPLACED = ("input_ids", "attention_mask", "position_ids")


@dataclass
class Responses:
    """What an engine generated for each sample row, before assembly.

    Attributes:
        tokens: ``[N, L]`` generated ids (L <= R); anything past a row's length is ignored.
        lengths: ``[N]`` response length of each row (tokens up to and including the stop).
        log_probs: ``[N, L]`` float log-prob of each generated token.
        stopped: ``[N]`` bool, True where the response ended on a stop token or string.
        versions: ``[N, L]`` the policy version each token was drawn with (None: one
            version for all, the engine's).
        routes: per row, the experts each position of prompt and response was routed
            to, ``[prompt + length, layers, k]`` (None: not recorded).
    """

    tokens: Tensor
    lengths: Tensor
    log_probs: Tensor
    stopped: Tensor
    versions: Tensor | None = None
    routes: list[Tensor] | None = None


def positions_from_mask(attention_mask: Tensor) -> Tensor:
    """Position ids of a left-padded batch: 0 on padding, 0, 1, 2, ... on real tokens."""
    mask = attention_mask.long()
    return (mask.cumsum(-1) - 1).clamp(min=0) * mask


def check_prompts(prompts: Batch, where: str) -> Batch:
    """Validate a prompt batch; return it with ``position_ids`` filled in if absent.

    Raises:
        ValueError / KeyError naming the missing or malformed column and what to pass.
    """
    for key in ("input_ids", "attention_mask"):
        if key not in prompts.tensors:
            raise KeyError(
                f"{where}: the prompt batch has no tensor column {key!r} (columns: "
                f"{prompts.keys()}); pass left-padded input_ids and attention_mask [B, P]."
            )
    ids, mask = prompts.tensors["input_ids"], prompts.tensors["attention_mask"]
    if ids.dim() != 2 or mask.shape != ids.shape:
        raise ValueError(
            f"{where}: input_ids {tuple(ids.shape)} and attention_mask {tuple(mask.shape)} "
            "must both be [B, P]."
        )
    if len(prompts) and bool((mask[:, -1] == 0).any()):
        raise ValueError(
            f"{where}: some prompts end with padding (attention_mask[:, -1] == 0); prompts "
            "must be LEFT-padded, e.g. tokenizer(..., padding_side='left')."
        )
    if "uid" not in prompts.non_tensors:
        raise KeyError(
            f"{where}: the prompt batch has no non-tensor column 'uid'; give each prompt an "
            "id (e.g. uid=[str(uuid4()) ...]) so that every sample is seeded reproducibly."
        )
    if "step" not in prompts.meta:
        raise KeyError(
            f"{where}: the prompt batch has no meta 'step'; set batch.meta['step'] to the "
            "training step so that a replayed step samples the same tokens."
        )
    if "position_ids" not in prompts.tensors:
        prompts = Batch(prompts.tensors, prompts.non_tensors, prompts.meta)
        prompts["position_ids"] = positions_from_mask(mask)
    return prompts


def expand_samples(prompts: Batch, n: int) -> tuple[Batch, list[str]]:
    """Each prompt row repeated n times (adjacent) and the sample uids ``f"{uid}/{k}"``."""
    rows = prompts.repeat(n, interleave=True)
    uids = [f"{uid}/{k}" for uid in prompts.non_tensors["uid"] for k in range(n)]
    return rows, uids


@dataclass(frozen=True)
class SampleRows:
    """A checked prompt batch and its samples: each prompt's rows repeated n times
    (adjacent), the sample uids ``f"{uid}/{k}"`` and their keys (`sample_keys` of the
    sampling seed, the batch's step and the uid)."""

    prompts: Batch
    rows: Batch
    uids: list[str]
    keys: Tensor

    def token_lists(self) -> list[list[int]]:
        """Each prompt's real tokens (its left padding dropped)."""
        ids, mask = self.prompts.tensors["input_ids"], self.prompts.tensors["attention_mask"]
        return [row[m].tolist() for row, m in zip(ids, mask.bool(), strict=True)]


def sample_rows(prompts: Batch, n: int, seed: int, where: str) -> SampleRows:
    """`prompts` checked (`check_prompts`, naming `where`), their ``n`` samples each."""
    prompts = check_prompts(prompts, where)
    rows, uids = expand_samples(prompts, n)
    return SampleRows(prompts, rows, uids, sample_keys(seed, int(prompts.meta["step"]), uids))


def assemble_output(
    rows: Batch, sample_uids: Sequence[str], out: Responses, max_new_tokens: int, pad_id: int
) -> Batch:
    """Build the output Batch of `generate` (see the module docstring) on CPU.

    Args:
        rows: the expanded prompt rows (`expand_samples`), one per sample.
        sample_uids: one id per row.
        out: the generated responses.
        max_new_tokens: R, the width every response is padded to.
        pad_id: the id written after the end of each response.
    """
    prompt_ids = rows.tensors["input_ids"].cpu()
    prompt_mask = rows.tensors["attention_mask"].cpu()
    prompt_pos = rows.tensors["position_ids"].cpu()
    n_rows, width = prompt_ids.shape[0], max_new_tokens
    lengths = out.lengths.cpu().long().clamp(max=width)
    mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)

    responses = torch.full((n_rows, width), pad_id, dtype=prompt_ids.dtype)
    log_probs = torch.zeros(n_rows, width, dtype=torch.float32)
    steps = min(out.tokens.shape[1], width)
    responses[:, :steps] = out.tokens[:, :steps].cpu().to(prompt_ids.dtype)
    log_probs[:, :steps] = out.log_probs[:, :steps].cpu().float()
    responses = responses.masked_fill(~mask, pad_id)
    log_probs = log_probs.masked_fill(~mask, 0.0)

    response_mask = mask.to(prompt_mask.dtype)
    offsets = torch.arange(1, width + 1, dtype=prompt_pos.dtype).unsqueeze(0)
    reasons = np.where(out.stopped.cpu().numpy(), FINISH_STOP, FINISH_LENGTH).astype(object)

    tensors = {k: v for k, v in rows.tensors.items() if k not in _REPLACED}
    tensors.update(
        prompts=prompt_ids,
        responses=responses,
        response_mask=response_mask,
        input_ids=torch.cat([prompt_ids, responses], dim=1),
        attention_mask=torch.cat([prompt_mask, response_mask], dim=1),
        position_ids=torch.cat([prompt_pos, prompt_pos[:, -1:] + offsets], dim=1),
        rollout_log_probs=log_probs,
    )
    if out.routes is not None and n_rows:
        tensors[ROUTES] = _placed_routes(
            out.routes, prompt_mask.sum(1), lengths, prompt_ids.shape[1], width
        )
    non_tensors = dict(rows.non_tensors)
    non_tensors["finish_reason"] = reasons
    non_tensors["sample_uid"] = np.array(list(sample_uids), dtype=object)
    return Batch(tensors, non_tensors, rows.meta)


def _placed_routes(
    routes: list[Tensor], prompt_lengths: Tensor, lengths: Tensor, prompt_width: int, width: int
) -> Tensor:
    """The rows' routing records aligned with ``input_ids`` ``[N, P + R]``: a row's
    prompt ends at column P (left padding), its response fills columns P... up to its
    length (cut to R); unrouted elsewhere."""
    _, layers, top_k = routes[0].shape
    dtype = routes[0].dtype
    out = torch.full(
        (len(routes), prompt_width + width, layers, top_k), unrouted(dtype), dtype=dtype
    )
    for i, record in enumerate(routes):
        start = prompt_width - int(prompt_lengths[i])
        count = min(len(record), int(prompt_lengths[i]) + int(lengths[i]))
        out[i, start : start + count] = record[:count]
    return out
