"""Variable-length attention for packed training rows, registered with transformers.

A packed row holds several sequences back to back (`rayrl.engines.packing`). Left to
itself, transformers' ``sdpa`` path turns the restarting ``position_ids`` into a dense
block-diagonal ``[T, T]`` mask and attends over all of it: cost and memory grow with
``(sum L)^2`` instead of ``sum L^2``. This module registers an attention
implementation, ``rayrl_varlen``, through transformers' public registries
(``AttentionInterface`` for the attention, ``AttentionMaskInterface`` for the mask):

* the engine passes each packed row's sequence boundaries as the keyword arguments
  transformers already threads down to every attention call (``cu_seq_lens_q/k``,
  ``max_length_q/k``: `packed_attention_kwargs`), built on the host so no step waits
  on the device;
* on CUDA with bf16/fp16 inputs, the attention is one call of
  ``torch.nn.attention.varlen.varlen_attn`` (flash, causal, ``cu_seqlens``); KV heads
  are expanded for grouped-query attention where that torch has no GQA argument;
* elsewhere (CPU, fp32) each sequence attends on its own (causal ``sdpa`` per slice):
  ``sum L^2``, never the whole row;
* any call without boundaries (generation with a padding mask, padded rows) is plain
  ``sdpa``, and no dense mask is built for an unpadded row;
* an attention module of a sequence-parallel engine (`rayrl.engines.ulysses`) holds a
  ``1/sp`` share of the packed row's tokens: the call trades it for a share of the heads
  over the whole row (all-to-all), attends as above, and trades back.

The model is loaded with ``attn_implementation="rayrl_varlen"`` (`attention_for`), so
the modeling code itself is untouched.
"""

from __future__ import annotations

import inspect
from functools import cache

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rayrl.engines.ulysses import attend, group_of

__all__ = ["VARLEN", "attention_for", "packed_attention_kwargs", "register_varlen_attention"]

VARLEN = "rayrl_varlen"
# ``(varlen_attn, has_gqa_argument)`` once `register_varlen_attention` ran and this
# torch has the kernel: a plain global, which ``torch.compile`` reads without a break.
_FLASH: tuple[object, bool] | None = None
# Attention implementations whose packed rows would attend over a dense mask.
_DENSE_ON_PACKED = ("sdpa", "eager")


def attention_for(attn_implementation: str, packed: bool) -> str:
    """The implementation to load a model with: `VARLEN` in place of ``sdpa`` (whose
    unpacked calls it runs as they were), or of ``eager`` when rows are packed; any
    other implementation unchanged. Registers `VARLEN` first."""
    if attn_implementation == "sdpa" or (packed and attn_implementation in _DENSE_ON_PACKED):
        register_varlen_attention()
        return VARLEN
    return attn_implementation


def packed_attention_kwargs(lengths: list[int], device: torch.device) -> dict:
    """Model keyword arguments that tell `VARLEN` where each packed sequence starts.

    ``lengths`` are the real-token counts of the sequences in the packed row, in order.
    """
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    cu = cu.to(device, non_blocking=True)
    longest = max(lengths, default=0)
    return {
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": longest,
        "max_length_k": longest,
    }


@cache
def register_varlen_attention() -> None:
    """Register `VARLEN` with transformers' attention and mask registries (once)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    global _FLASH
    _FLASH = _varlen_api()
    AttentionInterface.register(VARLEN, varlen_attention_forward)
    AttentionMaskInterface.register(VARLEN, varlen_mask)


def varlen_mask(*args, **kwargs):
    """transformers' mask function for `VARLEN`: none for an unpadded row (a packed
    row gets its boundaries from the kwargs, an unpadded one is plain causal), else
    ``sdpa``'s."""
    from transformers.masking_utils import sdpa_mask

    unpadded = kwargs.get("attention_mask") is None and kwargs.get("q_offset", 0) == 0
    if unpadded and kwargs.get("q_length") == kwargs.get("kv_length"):
        return None
    return sdpa_mask(*args, **kwargs)


def varlen_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers' attention signature: ``query`` ``[b, Hq, T, D]``, ``key``/``value``
    ``[b, Hkv, T, D]``; returns ``([b, T, Hq, D], None)``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.get("cu_seq_lens_q")
    sp = group_of(module)
    if sp is not None:
        return _sequence_parallel(sp, query, key, value, cu, kwargs, dropout, scaling), None
    if cu is None and attention_mask is None and query.shape[0] == 1:
        cu, kwargs = _boundaries_from_positions(kwargs)
    if cu is None or query.shape[0] != 1:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if dropout:
        raise ValueError("rayrl_varlen attention has no dropout; the engine trains without it.")
    return _varlen(query, key, value, cu, kwargs.get("max_length_q"), scaling).unsqueeze(0), None


def _varlen(query: Tensor, key: Tensor, value: Tensor, cu: Tensor, longest, scaling) -> Tensor:
    """Causal attention of each sequence of a packed row: ``[T, Hq, D]`` from ``[1, H, T,
    D]`` inputs; one flash call on CUDA in a half dtype, else sequence by sequence."""
    if query.is_cuda and _varlen_dtype(query, key, value) is not None and _FLASH:
        longest = int(longest or int((cu[1:] - cu[:-1]).max()))
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
        return _flash_varlen(q, k, v, cu, longest, scaling)
    return _per_sequence(query, key, value, cu, scaling)


def _sequence_parallel(sp, query, key, value, cu, kwargs: dict, dropout: float, scaling) -> Tensor:
    """A Ulysses rank's attention (`rayrl.engines.ulysses.attend`): its tokens in, the
    whole row attended per sequence with heads split over the group, its tokens out."""
    if cu is None or query.shape[0] != 1:
        raise ValueError(
            "a sequence-parallel model attends only packed rows with their boundaries "
            "(cu_seq_lens_q); run it through the training engine"
        )
    if dropout:
        raise ValueError("rayrl_varlen attention has no dropout; the engine trains without it.")
    longest = kwargs.get("max_length_q")

    def whole_row(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return _varlen(q, k, v, cu, longest, scaling).unsqueeze(0)

    return attend(sp, query, key, value, whole_row)


def _boundaries_from_positions(kwargs: dict) -> tuple[Tensor | None, dict]:
    """Sequence starts of a packed row from its restarting ``position_ids`` (a caller
    that packed without `packed_attention_kwargs`); None when the row is one sequence."""
    positions = kwargs.get("position_ids")
    if positions is None or positions.shape[-1] < 2:
        return None, kwargs
    row = positions.reshape(-1)
    starts = torch.nonzero(row[1:] != row[:-1] + 1).flatten() + 1
    if starts.numel() == 0:
        return None, kwargs
    edges = [0, *starts.tolist(), row.numel()]
    lengths = [b - a for a, b in zip(edges, edges[1:], strict=False)]
    extra = packed_attention_kwargs(lengths, row.device)
    return extra["cu_seq_lens_q"], {**kwargs, **extra}


def _varlen_dtype(q: Tensor, k: Tensor, v: Tensor) -> torch.dtype | None:
    """The half dtype the flash kernel runs in: autocast's, or the inputs' own."""
    if torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    dtypes = {q.dtype, k.dtype, v.dtype}
    if len(dtypes) == 1 and dtypes <= {torch.bfloat16, torch.float16}:
        return q.dtype
    return None


@cache
def _varlen_api() -> tuple[object, bool] | None:
    """``(varlen_attn, has_gqa_argument)``, or None when this torch has no varlen kernel."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, "enable_gqa" in inspect.signature(varlen_attn).parameters


def _flash_varlen(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, longest: int, scale) -> Tensor:
    """One flash call over the packed row: ``[T, Hq, D]`` from ``[T, H, D]`` inputs."""
    varlen_attn, has_gqa = _FLASH
    dtype = _varlen_dtype(q, k, v)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    extra = {}
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and has_gqa:
        extra["enable_gqa"] = True
    elif groups > 1:
        k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    return varlen_attn(q, k, v, cu, cu, longest, longest, scale=scale, window_size=(-1, 0), **extra)


def _per_sequence(query: Tensor, key: Tensor, value: Tensor, cu: Tensor, scale) -> Tensor:
    """Causal attention of each sequence on its own: ``[T, Hq, D]`` from ``[1, H, T, D]``
    inputs (kept 4-D: CPU sdpa's fused kernels want a batch dimension)."""
    edges = cu.tolist()
    gqa = query.shape[1] != key.shape[1]
    dtype = torch.promote_types(torch.promote_types(query.dtype, key.dtype), value.dtype)
    parts = []
    for start, end in zip(edges, edges[1:], strict=False):
        if end == start:
            continue
        q, k, v = (t[:, :, start:end].to(dtype) for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        parts.append(out[0].transpose(0, 1))
    return torch.cat(parts, dim=0)
