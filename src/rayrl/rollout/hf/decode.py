"""The HF rollout engine's lean decode loop: the same tokens as ``generate()``, less per token.

On a small model every decode step is mostly fixed cost, and ``generate()`` adds its own
each step (logits processors, stopping criteria lists, input preparation, output
bookkeeping): about an eighth of the demo's generation on a CPU. `lean_decode` runs
what ``generate()`` runs for rayrl's use of it and nothing else: one prefill forward,
then one forward per token on a `DynamicCache`, with the seeded sampler applied
directly to each step's float32 last-position logits and stops checked on whole
tensors. The forwards get exactly ``generate()``'s inputs (attention mask grown by one
column of ones, next position ids, ``logits_to_keep=1`` where the model takes it,
finished rows fed the pad id), so the tokens, log-probs and lengths are bitwise those
of ``generate()`` with the dynamic cache (tests/test_rollout_hf_lean.py checks greedy,
sampled, filtered, stop-token, EOS and stop-string runs).

`decode_threads` runs a small model's decode on one CPU thread: its ops are too small to
split, and waking a second thread for each costs more than it saves.

`can_lean_decode` says whether a model can run it: a decoder-only transformers model
that uses GenerationMixin's own input preparation and the default dynamic cache. Any
other model (encoder-decoder, custom ``prepare_inputs_for_generation``, remote code,
a recurrent cache) keeps ``generate()``.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from rayrl import progress
from rayrl.rollout.contract import Responses
from rayrl.rollout.sampling import SamplingParams, sample_tokens

__all__ = ["SINGLE_THREAD_DECODE_PARAMS", "can_lean_decode", "decode_threads", "lean_decode"]

# Below this many parameters a CPU decodes faster on one thread: a tiny model's ops are
# too small to split, and waking a second thread costs more than it saves
# (`bench/hf_decode.py --sweep`; figures in docs/benchmarks.md).
SINGLE_THREAD_DECODE_PARAMS = 1_000_000

# GenerationMixin methods whose behaviour `lean_decode` reproduces; a model overriding
# any of them prepares its inputs its own way and keeps ``generate()``.
_MIRRORED = ("prepare_inputs_for_generation", "_update_model_kwargs_for_generation", "_prefill")


def can_lean_decode(model: nn.Module) -> bool:
    """True when `lean_decode` gives this model exactly ``generate()``'s tokens."""
    try:
        from transformers import GenerationMixin
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    config = getattr(model, "config", None)
    if not isinstance(model, GenerationMixin) or config is None:
        return False
    if getattr(config, "is_encoder_decoder", False) or _is_remote_code(model):
        return False
    if any(_overrides(model, name, GenerationMixin) for name in _MIRRORED):
        return False
    supports_cache = getattr(model, "_supports_default_dynamic_cache", None)
    if supports_cache is None or not supports_cache():
        return False
    params = inspect.signature(model.forward).parameters
    return all(name in params for name in ("past_key_values", "position_ids", "attention_mask"))


@contextlib.contextmanager
def decode_threads(model: nn.Module, device: torch.device) -> Iterator[None]:
    """One torch thread while a model of fewer than `SINGLE_THREAD_DECODE_PARAMS`
    parameters decodes on a CPU; the thread count is restored after."""
    threads = torch.get_num_threads()
    small = sum(p.numel() for p in model.parameters()) < SINGLE_THREAD_DECODE_PARAMS
    if device.type != "cpu" or threads == 1 or not small:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@torch.no_grad()
def lean_decode(
    model: nn.Module,
    rows: dict[str, Tensor],
    keys: Tensor,
    sampling: SamplingParams,
    stop_ids: Tensor,
    stop_strings=None,
    pad_id: int = 0,
) -> Responses:
    """Prefill, then sample one token per row per forward until every row stopped or
    ``sampling.max_new_tokens`` were drawn. ``rows``: ``input_ids``, ``attention_mask``,
    ``position_ids`` [N, P] on the model's device; ``keys``: one sampler key per row;
    ``stop_strings``: a transformers ``StopStringCriteria`` or None."""
    from transformers import DynamicCache

    ids, mask, positions = rows["input_ids"], rows["attention_mask"], rows["position_ids"]
    n_rows, prompt_len = ids.shape
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    extra = {"logits_to_keep": 1} if _takes(model, "logits_to_keep") else {}
    pad = torch.tensor(pad_id, dtype=ids.dtype, device=ids.device)
    done = torch.zeros(n_rows, dtype=torch.bool, device=ids.device)
    stop_len = torch.zeros(n_rows, dtype=torch.long, device=ids.device)
    tokens: list[Tensor] = []
    log_probs: list[Tensor] = []
    seen = ids  # prompt + tokens so far: stop strings look back over it
    inputs, step_positions = ids, positions
    for step in range(sampling.max_new_tokens):
        out = model(
            input_ids=inputs,
            attention_mask=mask,
            position_ids=step_positions,
            past_key_values=cache,
            use_cache=True,
            return_dict=True,
            **extra,
        )
        scores = out.logits[:, -1].to(copy=True, dtype=torch.float32)
        del out
        chosen, chosen_lp = sample_tokens(scores, keys, step, sampling)
        progress.tick(tokens=n_rows)
        chosen = torch.where(done, pad, chosen)  # finished rows are fed the pad id
        tokens.append(chosen)
        log_probs.append(chosen_lp)
        hit = torch.isin(chosen, stop_ids)
        if stop_strings is not None:
            seen = torch.cat([seen, chosen[:, None]], dim=1)
            hit |= stop_strings(seen, scores)
        stop_len = torch.where(hit & ~done, step + 1, stop_len)
        done |= hit
        if bool(done.all()):
            break
        inputs = chosen[:, None]
        mask = torch.cat([mask, mask.new_ones(n_rows, 1)], dim=1)
        step_positions = step_positions[:, -1:] + 1
    steps = len(tokens)
    lengths = torch.where(done, stop_len, torch.full_like(stop_len, steps))
    return Responses(torch.stack(tokens, 1), lengths, torch.stack(log_probs, 1), done)


def _takes(model: nn.Module, name: str) -> bool:
    return name in inspect.signature(model.forward).parameters


def _overrides(model: nn.Module, name: str, base: type) -> bool:
    return getattr(type(model), name, None) is not getattr(base, name, None)


def _is_remote_code(model: nn.Module) -> bool:
    check = getattr(model, "is_remote_code", None)
    return bool(check()) if callable(check) else False
