"""Variable-length attention for packed training rows, registered with transformers.

A packed row holds several sequences back to back (`rayrl.train.packing`). Left to
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
* an attention module of a sequence-parallel engine (`rayrl.train.ulysses`) holds a
  ``1/sp`` share of the packed row's tokens: the call trades it for a share of the heads
  over the whole row (all-to-all), attends as above, and trades back.

The model is loaded with ``attn_implementation="rayrl_varlen"`` (`attention_for`), so
the modeling code itself is untouched.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rayrl.train.attention_variant import Variant
from rayrl.train.ulysses import SPGroup, attend, group_of

__all__ = [
    "SHARED_KV_INDEX",
    "VARLEN",
    "attention_for",
    "packed_attention_kwargs",
    "register_varlen_attention",
]

VARLEN = "rayrl_varlen"
# The keyword that gives each packed segment keys of its own (`packed_attention_kwargs`
# with ``keys``): for every segment in order, the packed positions of its keys.
SHARED_KV_INDEX = "rayrl_kv_index"
# ``(varlen_attn, has_gqa_argument)`` once `register_varlen_attention` ran and this
# torch has the kernel: a plain global, which ``torch.compile`` reads without a break.
_FLASH: tuple[Callable[..., Tensor], bool] | None = None
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


def packed_attention_kwargs(
    lengths: list[int],
    device: torch.device,
    keys: tuple[list[int], Tensor] | None = None,
) -> dict[str, Any]:
    """Model keyword arguments that tell `VARLEN` where each packed sequence starts.

    ``lengths`` are the real-token counts of the sequences in the packed row, in order.
    ``keys``, where a segment attends to more than itself (`rayrl.train.shared_prompts`):
    each segment's key count and, for all segments in order, the packed positions of
    their keys; a segment's queries are its last keys, each attending to the keys up
    to its own position.
    """
    cu = _offsets(lengths, device)
    longest = max(lengths, default=0)
    out = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest}
    out["max_length_k"] = longest
    if keys is not None:
        k_lengths, index = keys
        out["cu_seq_lens_k"] = _offsets(k_lengths, device)
        out["max_length_k"] = max(k_lengths, default=0)
        out[SHARED_KV_INDEX] = index.to(device, non_blocking=True)
    return out


def _offsets(lengths: list[int], device: torch.device) -> Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return cu.to(device, non_blocking=True)


@cache
def register_varlen_attention() -> None:
    """Register `VARLEN` with transformers' attention and mask registries (once)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    global _FLASH
    _FLASH = _varlen_api()
    AttentionInterface.register(VARLEN, varlen_attention_forward)
    AttentionMaskInterface.register(VARLEN, varlen_mask)


def varlen_mask(*args: Any, **kwargs: Any) -> Any:
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
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention signature: ``query`` ``[b, Hq, T, D]``, ``key``/``value``
    ``[b, Hkv, T, D]``; returns ``([b, T, Hq, D], None)``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    variant = Variant.of(module, kwargs)
    cu = kwargs.get("cu_seq_lens_q")
    sp = group_of(module)
    if sp is not None:
        return _sequence_parallel(
            sp, query, key, value, cu, kwargs, dropout, scaling, variant
        ), None
    if cu is None and attention_mask is None and query.shape[0] == 1:
        cu, kwargs = _boundaries_from_positions(kwargs)
    special = variant.binds(key.shape[2]) or variant.softcap is not None
    if cu is None and attention_mask is None and special:  # no mask: causal, each row
        return _each_row(query, key, value, scaling, variant), None
    if cu is None and variant.softcap is not None:  # a padded batch: sdpa has no soft-cap
        return _eager(query, key, value, attention_mask, scaling, variant.softcap), None
    if cu is None or query.shape[0] != 1:
        sdpa: tuple[Tensor, None] = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
        return sdpa
    if dropout:
        raise ValueError("rayrl_varlen attention has no dropout; the engine trains without it.")
    index, cu_k, longest_k = kwargs.get(SHARED_KV_INDEX), None, None
    if index is not None:  # segments with keys of their own (shared prompts)
        key, value = key.index_select(2, index), value.index_select(2, index)
        cu_k, longest_k = kwargs["cu_seq_lens_k"], kwargs.get("max_length_k")
    longest = kwargs.get("max_length_q")
    out = _varlen(query, key, value, cu, longest, scaling, cu_k, longest_k, variant=variant)
    return out.unsqueeze(0), None


def _varlen(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cu: Tensor,
    longest: int | None,
    scaling: float | None,
    cu_k: Tensor | None = None,
    longest_k: int | None = None,
    *,
    variant: Variant | None = None,
) -> Tensor:
    """Causal attention of each sequence of a packed row: ``[T, Hq, D]`` from ``[1, H, T,
    D]`` inputs; one flash call on CUDA in a half dtype, else sequence by sequence.
    With ``cu_k`` (segments with keys of their own: `packed_attention_kwargs`) a
    segment's queries are its last keys, ``longest_k`` the most keys of a segment.
    ``variant``: the layer's sliding window and soft-cap (a soft-capped layer attends
    sequence by sequence: the flash kernel has no soft-cap)."""
    variant = variant or Variant()
    if cu_k is None:
        cu_k, longest_k = cu, longest
    flash = query.is_cuda and _varlen_dtype(query, key, value) is not None and _FLASH
    if flash and variant.softcap is None:
        longest = int(longest or int((cu[1:] - cu[:-1]).max()))
        longest_k = int(longest_k or int((cu_k[1:] - cu_k[:-1]).max()))
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
        return _flash_varlen(q, k, v, (cu, cu_k), (longest, longest_k), scaling, variant.window)
    return _per_sequence(query, key, value, cu, scaling, cu_k, variant)


def _each_row(
    query: Tensor, key: Tensor, value: Tensor, scaling: float | None, variant: Variant
) -> Tensor:
    """``[b, T, Hq, D]``: each row of a batch without a mask attends causally on its own
    (its queries the last positions of its keys, as in a decode step), in ``variant``."""
    cu = torch.tensor([0, query.shape[2]], dtype=torch.int32, device=query.device)
    cu_k = torch.tensor([0, key.shape[2]], dtype=torch.int32, device=query.device)
    rows = [
        _varlen(
            query[i : i + 1],
            key[i : i + 1],
            value[i : i + 1],
            cu,
            None,
            scaling,
            cu_k,
            None,
            variant=variant,
        )
        for i in range(query.shape[0])
    ]
    return torch.stack(rows)


def _sequence_parallel(
    sp: SPGroup,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cu: Tensor | None,
    kwargs: dict[str, Any],
    dropout: float,
    scaling: float | None,
    variant: Variant,
) -> Tensor:
    """A Ulysses rank's attention (`rayrl.train.ulysses.attend`): its tokens in, the
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
        return _varlen(q, k, v, cu, longest, scaling, variant=variant).unsqueeze(0)

    return attend(sp, query, key, value, whole_row)


def _boundaries_from_positions(kwargs: dict[str, Any]) -> tuple[Tensor | None, dict[str, Any]]:
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
def _varlen_api() -> tuple[Callable[..., Tensor], bool] | None:
    """``(varlen_attn, has_gqa_argument)``, or None when this torch has no varlen kernel."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, "enable_gqa" in inspect.signature(varlen_attn).parameters


def _flash_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu: tuple[Tensor, Tensor],
    longest: tuple[int, int],
    scale: float | None,
    window: int | None = None,
) -> Tensor:
    """One flash call over the packed row: ``[T, Hq, D]`` from ``[T, H, D]`` inputs;
    ``cu`` and ``longest`` are (queries', keys'). The causal window ``(-1, 0)`` (a
    sliding one, ``(window - 1, 0)``: the query and the ``window - 1`` keys before it)
    is aligned to each segment's last key (flash's rule where a segment has more keys
    than queries)."""
    if _FLASH is None:
        raise RuntimeError(
            "no flash varlen kernel: this torch has no torch.nn.attention.varlen, or "
            "register_varlen_attention() has not run"
        )
    varlen_attn, has_gqa = _FLASH
    dtype = _varlen_dtype(q, k, v)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    extra: dict[str, Any] = {}
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and has_gqa:
        extra["enable_gqa"] = True
    elif groups > 1:
        k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    (cu_q, cu_k), (longest_q, longest_k) = cu, longest
    return varlen_attn(
        q,
        k,
        v,
        cu_q,
        cu_k,
        longest_q,
        longest_k,
        scale=scale,
        window_size=(-1 if window is None else window - 1, 0),
        **extra,
    )


def _per_sequence(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cu: Tensor,
    scale: float | None,
    cu_k: Tensor,
    variant: Variant | None = None,
) -> Tensor:
    """Causal attention of each sequence on its own: ``[T, Hq, D]`` from ``[1, H, T, D]``
    inputs (kept 4-D: CPU sdpa's fused kernels want a batch dimension). A segment with
    more keys than queries: query i sees the keys up to ``i + keys - queries``; in a
    sliding window, only the ``window`` keys that end there."""
    variant = variant or Variant()
    gqa = query.shape[1] != key.shape[1]
    dtype = torch.promote_types(torch.promote_types(query.dtype, key.dtype), value.dtype)
    parts = []
    q_edges, k_edges = cu.tolist(), cu_k.tolist()
    for q0, q1, k0, k1 in zip(q_edges, q_edges[1:], k_edges, k_edges[1:], strict=False):
        if q1 == q0:
            continue
        q = query[:, :, q0:q1].to(dtype)
        k, v = (t[:, :, k0:k1].to(dtype) for t in (key, value))
        if variant.softcap is not None:
            seen = _causal(q1 - q0, k1 - k0, variant.window, q.device)
            parts.append(_eager(q, k, v, seen, scale, variant.softcap)[0])
            continue
        if k1 - k0 == q1 - q0 and not variant.binds(k1 - k0):
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=gqa
            )
        else:
            seen = _causal(q1 - q0, k1 - k0, variant.window, q.device)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=seen, scale=scale, enable_gqa=gqa
            )
        parts.append(out[0].transpose(0, 1))
    return torch.cat(parts, dim=0)


def _causal(queries: int, keys: int, window: int | None, device: torch.device) -> Tensor:
    """``[queries, keys]``: which keys each query sees, the queries being the last
    ``queries`` positions; in a sliding window, the ``window`` keys ending at its own."""
    seen = torch.ones(queries, keys, dtype=torch.bool, device=device)
    seen = seen.tril(diagonal=keys - queries)
    if window is not None:
        seen = seen.triu(diagonal=keys - queries - window + 1)
    return seen


def _eager(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Tensor | None,
    scale: float | None,
    softcap: float,
) -> Tensor:
    """Soft-capped attention as transformers' eager path computes it: ``[b, T, Hq, D]``
    from ``[b, H, T, D]`` inputs; ``mask`` boolean (True: attended) or additive."""
    groups = query.shape[1] // key.shape[1]
    key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(query, key.transpose(2, 3)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    elif mask is not None:
        scores = scores + mask[..., : key.shape[2]]
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, value).transpose(1, 2).contiguous()
