"""Multi-turn episodes on an HF model: rounds of decoding over one growing KV cache.

The HF engine's scheme is simpler than the native engine's (where a sample waiting
for its tools leaves the batch and the others keep decoding): it runs in *rounds*.

1. A round starts with one forward over each active row's new tokens (the prompts in
   the first round; afterwards what the row's cache lacks: its last sampled token
   and the appended tool response and turn separators), left-padded to the longest,
   then decodes one token per row per forward until every row of the round stopped
   (a stop token or string) or reached its length limit. A row that stopped is fed
   the pad id under a 0 in the attention mask until the round ends, so the holes
   never enter its context.
2. Between rounds, every row whose turn ended goes to the turn driver; their tools
   run concurrently, and the round waits for all of them. Rows that continue keep
   their cache rows (the others' are dropped) and form the next round.

A sampled token is drawn with the seeded sampler at its column in the response
(appended tokens count), as in the native engine, so both engines draw the same
tokens and any sample replays alone. The cost of the scheme: a slow tool holds up its
round, and rows that stopped early wait for the round's longest turn.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn

from rayrl import progress
from rayrl.engines.rollout.contract import Responses
from rayrl.engines.rollout.sampling import SamplingParams, sample_tokens
from rayrl.engines.rollout.turns import TurnDriver

__all__ = ["decode_turns"]


class _Rows:
    """Per-row bookkeeping of a multi-turn decode, in numpy (sample ids index it)."""

    def __init__(self, n_rows: int, width: int, prompt_len: np.ndarray) -> None:
        self.tokens = np.zeros((n_rows, width), dtype=np.int64)
        self.log_probs = np.zeros((n_rows, width), dtype=np.float32)
        self.gen = np.zeros(n_rows, dtype=np.int64)  # response tokens so far
        self.stopped = np.zeros(n_rows, dtype=bool)
        self.turn_start = np.zeros(n_rows, dtype=np.int64)
        self.in_cache = prompt_len.astype(np.int64).copy()  # tokens whose K/V the cache holds
        self.prompt_len = prompt_len.astype(np.int64)
        self.width = width


@torch.no_grad()
def decode_turns(
    model: nn.Module,
    rows: dict[str, Tensor],
    keys: Tensor,
    sampling: SamplingParams,
    stop_ids: Tensor,
    stop_strings,
    pad_id: int,
    turns: TurnDriver,
) -> Responses:
    """Run multi-turn episodes (module docstring) for left-padded prompt ``rows``
    (``input_ids``, ``attention_mask``, ``position_ids`` [N, P] on the model's device).

    Args:
        keys: one sampler key per row.
        stop_ids: token ids that end a turn.
        stop_strings: a `StopStrings` (or None): strings that end a turn.
        turns: the turn driver told of every turn end.
    """
    from transformers import DynamicCache

    ids, mask, positions = rows["input_ids"], rows["attention_mask"], rows["position_ids"]
    device = ids.device
    state = _Rows(len(ids), sampling.max_new_tokens, mask.sum(1).cpu().numpy())
    stops = stop_ids.cpu().numpy()
    check = None if stop_strings is None else stop_strings.checker(state.tokens, state.turn_start)
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    step = _Forward(model, cache, mask)
    active = np.arange(len(ids))
    chunk = (ids, mask, positions)
    while len(active):
        logits = step(*chunk)
        _decode_round(step, logits, active, state, keys, sampling, stops, check, pad_id, device)
        answers = _hand_over(turns, active, state)
        keep = [i for i, s in enumerate(active.tolist()) if answers.get(s) is not None]
        for s, tokens in answers.items():
            if tokens is not None:
                _append(state, s, tokens)
        active = active[keep]
        step.select(keep)
        if len(active):
            chunk = _chunk(state, active, pad_id, device)
    return Responses(
        tokens=torch.from_numpy(state.tokens),
        lengths=torch.from_numpy(state.gen.copy()),
        log_probs=torch.from_numpy(state.log_probs),
        stopped=torch.from_numpy(state.stopped.copy()),
    )


class _Forward:
    """One forward over the cache's rows; keeps the attention mask of everything cached."""

    def __init__(self, model: nn.Module, cache, mask: Tensor) -> None:
        import inspect

        self.model, self.cache = model, cache
        self.mask = mask[:, :0]
        params = inspect.signature(model.forward).parameters
        self.extra = {"logits_to_keep": 1} if "logits_to_keep" in params else {}

    def __call__(self, input_ids: Tensor, mask: Tensor, positions: Tensor) -> Tensor:
        self.mask = torch.cat([self.mask, mask], dim=1)
        out = self.model(
            input_ids=input_ids,
            attention_mask=self.mask,
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            return_dict=True,
            **self.extra,
        )
        return out.logits[:, -1].to(copy=True, dtype=torch.float32)

    def select(self, keep: list[int]) -> None:
        """Keep only these cache rows (in this order)."""
        if len(keep) == len(self.mask):
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
        self.mask = self.mask.index_select(0, index)
        if len(keep):
            self.cache.batch_select_indices(index)


def _decode_round(step, logits, active, state, keys, sampling, stops, check, pad_id, device):
    """Sample from the round's first logits, then decode until every row is done."""
    done = _sample(logits, active, state, keys, sampling, stops, check)
    pad = torch.tensor(pad_id, dtype=torch.long, device=device)
    while not done.all():
        live = ~done
        last = torch.from_numpy(state.tokens[active, np.maximum(state.gen[active] - 1, 0)])
        inputs = torch.where(torch.from_numpy(live).to(device), last.to(device), pad)
        column = torch.from_numpy(live.astype(np.int64)).to(device)[:, None]
        positions = torch.from_numpy(state.in_cache[active]).to(device)[:, None]
        logits = step(inputs[:, None], column.to(step.mask.dtype), positions)
        state.in_cache[active[live]] += 1
        rows = torch.from_numpy(np.flatnonzero(live)).to(device)
        done[live] = _sample(
            logits.index_select(0, rows), active[live], state, keys, sampling, stops, check
        )


def _sample(logits, samples, state, keys, sampling, stops, check) -> np.ndarray:
    """Draw each row's next token at its response column; True where the row is done
    for this round (a stop, or its length limit)."""
    at = state.gen[samples]
    positions = torch.from_numpy(at).to(logits.device)
    index = torch.from_numpy(samples).to(keys.device)
    chosen, log_probs = sample_tokens(logits, keys.index_select(0, index), positions, sampling)
    chosen = chosen.cpu().numpy()
    state.tokens[samples, at] = chosen
    state.log_probs[samples, at] = log_probs.float().cpu().numpy()
    state.gen[samples] = at + 1
    progress.tick(tokens=len(samples))
    hit = np.isin(chosen, stops) if len(stops) else np.zeros(len(samples), dtype=bool)
    if check is not None:
        hit |= check(samples, at + 1)
    state.stopped[samples] = hit
    return hit | (at + 1 >= state.width)


def _hand_over(turns: TurnDriver, active: np.ndarray, state: _Rows) -> dict[int, object]:
    """Give every row whose turn ended (with room left) to the driver; wait for all.

    Returns each such row's tokens to append, or None where its episode ends.
    """
    ended = [s for s in active.tolist() if state.stopped[s] and state.gen[s] < state.width]
    for s in ended:
        turns.turn_ended(s, state.tokens[s, : state.gen[s]].copy())
    answers: dict[int, object] = {}
    while len(answers) < len(ended):
        for answer in turns.take_ready(wait=True):
            answers[answer.sample] = answer.tokens
            if answer.tokens is None:
                state.stopped[answer.sample] = answer.stopped
    return answers


def _append(state: _Rows, sample: int, tokens) -> None:
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    at, count = int(state.gen[sample]), len(tokens)
    if count == 0 or at + count >= state.width:
        raise ValueError(
            f"HF rollout engine: sample {sample} has {at} of {state.width} response tokens; "
            f"appending {count} must leave room for one more."
        )
    state.tokens[sample, at : at + count] = tokens
    state.gen[sample] = at + count
    state.turn_start[sample] = at + count
    state.stopped[sample] = False


def _chunk(state: _Rows, active: np.ndarray, pad_id: int, device) -> tuple[Tensor, Tensor, Tensor]:
    """Each active row's tokens the cache lacks, left-padded: ids, mask, positions."""
    pieces = []
    for s in active.tolist():
        fed = int(state.in_cache[s] - state.prompt_len[s])
        pieces.append(state.tokens[s, fed : state.gen[s]])
    width = max(len(p) for p in pieces)
    ids = np.full((len(active), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(active), width), dtype=np.int64)
    positions = np.zeros((len(active), width), dtype=np.int64)
    for row, (s, piece) in enumerate(zip(active.tolist(), pieces, strict=True)):
        count = len(piece)
        ids[row, width - count :] = piece
        mask[row, width - count :] = 1
        positions[row, width - count :] = state.in_cache[s] + np.arange(count)
        state.in_cache[s] += count
    return tuple(torch.from_numpy(a).to(device) for a in (ids, mask, positions))
