"""One micro-batch through the model: per-response-token log-probs, entropy or values.

`response_outputs` runs the model on a padded or a packed micro-batch and returns
``[b, R]`` float32 tensors over the response columns, zero where a response token is
padding (or is the first token of a sequence and so has no logit predicting it).

Only the logits that predict response tokens are computed (``logits_to_keep`` with an
index tensor), and log-probs and entropy are computed from them in chunks
(`rayrl.algos.entropy`), so memory stays bounded at a 150k vocabulary: the float32
softmax is never materialised for more than one chunk of tokens at a time.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from rayrl.algos.entropy import log_probs_and_entropy, log_probs_from_logits
from rayrl.batch import Batch
from rayrl.engines.attention import packed_attention_kwargs
from rayrl.engines.packing import ResponseIndex, pack_sequences, padded_response_index

__all__ = ["MODEL_INPUTS", "default_position_ids", "response_outputs"]

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "responses")


def default_position_ids(attention_mask: Tensor) -> Tensor:
    """verl's position ids: 0 at each row's first real token, counting real tokens."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def _model_inputs(
    micro: Batch, packed: bool, device: torch.device
) -> tuple[dict[str, Tensor], ResponseIndex]:
    """Model kwargs and the response index, built where ``micro`` is, then moved."""
    ids, mask = micro["input_ids"], micro["attention_mask"]
    positions = micro["position_ids"] if "position_ids" in micro else default_position_ids(mask)
    response_len = micro["responses"].shape[1]
    if packed:
        p = pack_sequences(ids, mask, positions, response_len)
        inputs, index = {"input_ids": p.input_ids, "position_ids": p.position_ids}, p.response
    else:
        index = padded_response_index(ids, mask, response_len)
        inputs = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
    inputs = {k: v.to(device, non_blocking=True) for k, v in inputs.items()}
    if packed:  # sequence boundaries for varlen attention, computed here on the host
        lengths = [n for n in mask.sum(dim=1).tolist() if n > 0]
        inputs.update(packed_attention_kwargs(lengths, device))
    index = ResponseIndex(
        valid=index.valid.to(device, non_blocking=True),
        logit_index=index.logit_index.to(device, non_blocking=True),
        labels=index.labels.to(device, non_blocking=True),
    )
    return inputs, index


def _place(values: Tensor, index: ResponseIndex, packed: bool) -> Tensor:
    """``[b, R]`` float32 from per-kept-logit values, zero at invalid positions."""
    values = values.float()
    if packed:
        return index.scatter(values)
    return torch.where(index.valid, values, torch.zeros_like(values))


def response_outputs(
    model: nn.Module,
    micro: Batch,
    *,
    packed: bool,
    value_head: bool = False,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int = 1024,
    device: torch.device | str | None = None,
) -> dict[str, Tensor]:
    """Run ``model`` on one micro-batch.

    The packing and index bookkeeping run where ``micro`` lives (best on CPU: no
    device synchronisation); only the model inputs move to ``device`` (default: the
    device of ``micro``).

    Args:
        model: a causal LM (or a token-classification model with one label when
            ``value_head``), possibly FSDP-sharded.
        micro: ``input_ids``, ``attention_mask``, ``responses`` and optionally
            ``position_ids`` (verl's layout, see `rayrl.engines.packing`).
        packed: drop padding and pack the sequences into one row.
        value_head: return ``values`` (the head's output at the position before each
            response token, i.e. the state the token is chosen in).
        temperature: logits are divided by it before the softmax.
        with_entropy: also return ``entropy``.
        chunk_size: tokens per chunk of the log-softmax.
        device: where the model runs.

    Returns:
        ``{"log_probs": ..., "entropy": ...}`` or ``{"values": ...}``, each ``[b, R]``.
    """
    device = torch.device(device) if device is not None else micro["input_ids"].device
    inputs, index = _model_inputs(micro, packed, device)
    if value_head:
        scores = model(**inputs, use_cache=False).logits[..., 0]
        picked = scores[0, index.logit_index] if packed else scores[:, index.logit_index]
        return {"values": _place(picked, index, packed)}
    logits = model(**inputs, use_cache=False, logits_to_keep=index.logit_index).logits
    labels = index.labels if packed else index.labels.clamp(min=0)  # pads may be negative
    if packed:
        logits = logits[0]
    if with_entropy:
        log_probs, entropy = log_probs_and_entropy(logits, labels, temperature, chunk_size)
        return {
            "log_probs": _place(log_probs, index, packed),
            "entropy": _place(entropy, index, packed),
        }
    log_probs = log_probs_from_logits(logits, labels, temperature, chunk_size)
    return {"log_probs": _place(log_probs, index, packed)}
