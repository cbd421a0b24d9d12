"""One pass over a prompt shared by several rows: GRPO's n samples of a prompt trained
with the prompt's tokens run through the model once.

A GRPO micro-batch holds each prompt n times (once per sample). The tokens of a causal
model's prompt do not depend on what follows them, so running the prompt n times
computes the same activations n times: at the reference shape, 512 x (256 + 256), the
prompts are half the update's tokens and 7/8 of that work is repeated.
`share_prompts` packs a micro-batch so each distinct prompt appears once, followed by
the responses of every row that has it:

    [prompt A][response A1][response A2] ... [prompt B][response B1] ...

Each segment attends causally to itself, and a response also to its prompt: the
attention is told, besides each segment's query length (``cu_seq_lens_q``), its keys
(``cu_seq_lens_k`` with ``SHARED_KV_INDEX``: the packed positions of the prompt's tokens
then the segment's own), and each response query sees its prompt and its own earlier
tokens (`rayrl.train.attention`: a causal mask aligned to the keys' end). Position
ids are the rows' own, so a response's tokens have the positions they had after their
prompt. The logit predicting a response's first token is read at its prompt's last
token, shared by the rows of the group; the others at the response's previous token.
So log-probs, entropy and their gradients equal those of the rows run one by one (to
rounding: sums happen in another order), and the shared prompt's gradient is the sum
of what each row would give it.

Rows share a prompt when their real prompt tokens and positions are equal (the tokens
are compared, not a uid). A micro-batch where no two rows share a prompt is packed as
before (`rayrl.train.packing.pack_sequences`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from rayrl.train.attention import SHARED_KV_INDEX, VARLEN, attention_for
from rayrl.train.packing import ResponseIndex, check_contiguous, padded_response_index

if TYPE_CHECKING:
    from rayrl.batch import Batch

__all__ = [
    "SHARED_KV_INDEX",
    "SharedPack",
    "prompt_groups",
    "repeated_prompt_tokens",
    "share_prompts",
    "share_prompts_on",
]

log = logging.getLogger(__name__)


def share_prompts_on(
    setting: bool | str, device: torch.device, attn_implementation: str = "sdpa"
) -> bool:
    """Whether an engine on ``device`` shares prompts under ``setting`` (true, false or
    ``"auto"``: on CUDA, where the packed row's attention is one kernel); never where
    the model's attention is not rayrl's varlen one (only it reads a segment's keys)."""
    if setting not in (True, False) and str(setting).lower() != "auto":
        raise ValueError(
            f"share_prompts must be true, false or auto, got {setting!r} "
            "(actor_rollout_ref.model.share_prompts)"
        )
    on = setting if isinstance(setting, bool) else device.type == "cuda"
    if on and attention_for(attn_implementation, packed=True) != VARLEN:
        log.info("share_prompts: off with attn_implementation=%s", attn_implementation)
        return False
    return on


@dataclass
class SharedPack:
    """A micro-batch packed with each distinct prompt once."""

    input_ids: Tensor  # [1, T]
    position_ids: Tensor  # [1, T]
    response: ResponseIndex  # as `pack_sequences` gives it, over the packed row
    q_lengths: list[int]  # tokens of each segment (a prompt, or one row's response)
    k_lengths: list[int]  # keys of each segment: a response's prompt and itself
    kv_index: Tensor  # [sum k_lengths] packed positions of each segment's keys
    rows_per_prompt: list[int]  # rows in each group, in packing order
    where: Tensor  # [b, P + R] packed position of each real token (-1: padding)

    @property
    def tokens(self) -> int:
        return int(self.input_ids.shape[1])


def share_prompts(
    input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, response_len: int
) -> SharedPack | None:
    """The micro-batch packed with each distinct prompt once, or None when no two rows
    share a prompt. Layout as `pack_sequences` expects it (left-padded prompts of width
    ``P``, right-padded responses of width ``response_len``); runs on the host."""
    padded = padded_response_index(input_ids, attention_mask, response_len)
    mask = attention_mask.bool()
    check_contiguous(mask, position_ids)
    groups = _groups(input_ids, mask, position_ids, input_ids.shape[1] - response_len)
    if all(len(rows) == 1 for rows in groups.values()):
        return None
    return _pack(input_ids, mask, position_ids, response_len, groups, padded)


def prompt_groups(batch: Batch, response_len: int) -> list[tuple[list[int], int]]:
    """``(rows, real prompt length)`` of each distinct prompt of ``batch``, in order of
    first appearance (`rayrl.train.packing.plan_shared_budget`)."""
    ids, mask = batch["input_ids"], batch["attention_mask"].bool()
    positions = batch["position_ids"] if "position_ids" in batch else mask.long().cumsum(-1)
    prompt_width = ids.shape[1] - response_len
    groups = _groups(ids, mask, positions, prompt_width)
    return [(rows, int(mask[rows[0], :prompt_width].sum())) for rows in groups.values()]


def repeated_prompt_tokens(batch: Batch, response_len: int) -> int:
    """Real prompt tokens of ``batch``'s rows beyond the first row of each distinct
    prompt: what sharing prompts leaves out when each prompt's rows run together."""
    return sum(prompt * (len(rows) - 1) for rows, prompt in prompt_groups(batch, response_len))


def _groups(
    ids: Tensor, mask: Tensor, positions: Tensor, prompt_width: int
) -> dict[bytes, list[int]]:
    """Rows by their real prompt (tokens and positions), in order of first appearance."""
    groups: dict[bytes, list[int]] = {}
    # as arrays: indexing a tensor row by row costs several times more
    p_ids, p_mask, p_pos = (t[:, :prompt_width].cpu().numpy() for t in (ids, mask, positions))
    for row, keep in enumerate(p_mask):
        key = p_ids[row][keep].tobytes() + b"|" + p_pos[row][keep].tobytes()
        groups.setdefault(key, []).append(row)
    return groups


def _pack(
    ids: Tensor,
    mask: Tensor,
    positions: Tensor,
    response_len: int,
    groups: dict[bytes, list[int]],
    padded: ResponseIndex,
) -> SharedPack:
    prompt_width = ids.shape[1] - response_len
    tokens: list[Tensor] = []
    pos: list[Tensor] = []
    q_lengths: list[int] = []
    k_lengths: list[int] = []
    kv: list[Tensor] = []
    logit_at = torch.full(padded.valid.shape, -1, dtype=torch.long)  # packed position
    where = torch.full(ids.shape, -1, dtype=torch.long)
    start = 0
    for rows in groups.values():
        first = rows[0]
        keep = mask[first, :prompt_width]
        prompt = torch.arange(start, start + int(keep.sum()))
        if len(prompt):
            tokens.append(ids[first, :prompt_width][keep])
            pos.append(positions[first, :prompt_width][keep])
            q_lengths.append(len(prompt))
            k_lengths.append(len(prompt))
            kv.append(prompt)
            start += len(prompt)
        for row in rows:
            where[row, :prompt_width][mask[row, :prompt_width]] = prompt
            real = mask[row, prompt_width:]
            n = int(real.sum())
            if n == 0:
                continue
            own = torch.arange(start, start + n)
            tokens.append(ids[row, prompt_width:][real])
            pos.append(positions[row, prompt_width:][real])
            q_lengths.append(n)
            k_lengths.append(len(prompt) + n)
            kv.extend((prompt, own))
            # the logit before response column c: the prompt's last token for c = 0
            before = torch.cat([prompt[-1:], own[:-1]]) if len(prompt) else own[:-1]
            logit_at[row, len(prompt) == 0 : n] = before
            where[row, prompt_width:][real] = own
            start += n
    valid = padded.valid
    return SharedPack(
        input_ids=torch.cat(tokens).unsqueeze(0),
        position_ids=torch.cat(pos).unsqueeze(0),
        response=ResponseIndex(
            valid=valid, logit_index=logit_at[valid], labels=padded.labels[valid]
        ),
        q_lengths=q_lengths,
        k_lengths=k_lengths,
        kv_index=torch.cat(kv),
        rows_per_prompt=[len(rows) for rows in groups.values()],
        where=where,
    )
