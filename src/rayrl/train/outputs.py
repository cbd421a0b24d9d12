"""One micro-batch through the model: per-response-token log-probs, entropy or values.

`response_outputs` runs the model on a padded or a packed micro-batch and returns
``[b, R]`` float32 tensors over the response columns, zero where a response token is
padding (or is the first token of a sequence and so has no logit predicting it).

Only the positions that predict response tokens reach the output head
(``logits_to_keep`` with an index tensor). A model whose head is a
`rayrl.train.logprob_head.LogProbHead` (the training engine installs one) returns
log-probs and entropy from hidden states chunk by chunk, so no ``[tokens x vocab]``
logits exist; other models' logits go through the chunked log-softmax of
`rayrl.algos.entropy`. With ``with_sum_pi_squared`` each token's sum over the vocabulary
of its squared probabilities comes back too (``sum_pi_squared``, from the same logits,
without a gradient: the optimal token baseline reads it). A sequence-parallel model
(`rayrl.train.ulysses`) runs this rank's share of the packed row and gathers every
rank's outputs. With
``share_prompts`` rows with the same prompt run it once (`rayrl.train.shared_prompts`).
Inside a `rayrl.train.router_replay.routing` context the model's mixture-of-experts
routers replay, record or compare the micro-batch's routing, laid out as its input is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from rayrl.algos.entropy import (
    log_probs_and_entropy,
    log_probs_from_logits,
    sum_pi_squared_from_logits,
)
from rayrl.batch import Batch
from rayrl.train.attention import packed_attention_kwargs
from rayrl.train.logprob_head import logprob_head_of
from rayrl.train.moe_aux import AUX_KEY
from rayrl.train.packing import ResponseIndex, pack_sequences, padded_response_index
from rayrl.train.router_replay import active_routing
from rayrl.train.shared_prompts import share_prompts as share_prompts_of
from rayrl.train.ulysses import SPGroup, gather_kept, split_packed
from rayrl.train.vision_inputs import (
    IMAGE_COLUMN,
    SPLICE_KEY,
    VisionModel,
    image_inputs,
    packed_image_inputs,
)

__all__ = [
    "IMAGE_COLUMN",
    "MODEL_INPUTS",
    "default_position_ids",
    "response_outputs",
    "response_width",
]

# What the model is run on: token ids, mask and (optionally) positions over prompt and
# response, and the responses' width R, read from `responses` or, when a caller sends
# only the mask, `response_mask` (`response_width`). A vision-language model's passes
# also read the rows' images, `IMAGE_COLUMN` (only batches of prompts with images have it).
MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "response_mask")


def response_width(batch: Batch) -> int:
    """R, the responses' padded width: of ``responses``, else of ``response_mask``."""
    for key in ("responses", "response_mask"):
        if key in batch:
            return int(batch[key].shape[1])
    raise KeyError(
        f"the engine needs a responses or response_mask column for the responses' width; "
        f"the batch has {batch.keys()}."
    )


def default_position_ids(attention_mask: Tensor) -> Tensor:
    """verl's position ids: 0 at each row's first real token, counting real tokens."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def _model_inputs(
    micro: Batch,
    packed: bool,
    device: torch.device,
    share: bool = False,
    vision: VisionModel | None = None,
) -> tuple[dict[str, Any], ResponseIndex, bool, Tensor]:
    """Model kwargs, the response index, whether the row is packed, and where each
    token of ``micro`` (``[b, P + R]``) sits in the model's input, flattened (-1: left
    out), built where ``micro`` is, then moved (all but the last). ``share``: rows with
    the same prompt run it once (`rayrl.train.shared_prompts`), when some do.
    ``vision``: the rows' images go in beside their ids, with the model's M-RoPE
    positions (`rayrl.train.vision_inputs`)."""
    ids, mask = micro["input_ids"], micro["attention_mask"]
    positions = micro["position_ids"] if "position_ids" in micro else default_position_ids(mask)
    response_len = response_width(micro)
    images = image_inputs(vision, micro, response_len) if vision is not None else None
    shared = share_prompts_of(ids, mask, positions, response_len) if share else None
    attention = {}
    if shared is not None:
        inputs = {"input_ids": shared.input_ids, "position_ids": shared.position_ids}
        index, packed, where = shared.response, True, shared.where
        keys = (shared.k_lengths, shared.kv_index)
        attention = packed_attention_kwargs(shared.q_lengths, device, keys=keys)
    elif packed:
        p = pack_sequences(ids, mask, positions, response_len)
        inputs, index = {"input_ids": p.input_ids, "position_ids": p.position_ids}, p.response
        if images is not None:  # each sequence's own M-RoPE positions, text ones first
            images = packed_image_inputs(images, mask, p.position_ids)
        # sequence boundaries for varlen attention, computed here on the host
        lengths = [n for n in mask.sum(dim=1).tolist() if n > 0]
        attention = packed_attention_kwargs(lengths, device)
        where = torch.full(mask.shape, -1, dtype=torch.long)
        where[mask.bool()] = torch.arange(p.input_ids.shape[1])
    else:
        index = padded_response_index(ids, mask, response_len)
        inputs = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
        where = torch.arange(ids.numel()).view(ids.shape)
    if images is not None:
        inputs["position_ids"] = images.position_ids
    moved: dict[str, Any] = {k: v.to(device, non_blocking=True) for k, v in inputs.items()}
    if images is not None:
        moved[SPLICE_KEY] = images.splice.to(device)
    moved.update(attention)
    inputs = moved
    index = ResponseIndex(
        valid=index.valid.to(device, non_blocking=True),
        logit_index=index.logit_index.to(device, non_blocking=True),
        labels=index.labels.to(device, non_blocking=True),
    )
    return inputs, index, packed, where


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
    sp: SPGroup | None = None,
    share_prompts: bool = False,
    vision: VisionModel | None = None,
    aux_loss: bool = False,
    with_sum_pi_squared: bool = False,
) -> dict[str, Tensor]:
    """Run ``model`` on one micro-batch.

    The packing and index bookkeeping run where ``micro`` lives (best on CPU: no
    device synchronisation); only the model inputs move to ``device`` (default: the
    device of ``micro``).

    Args:
        model: a causal LM (or a token-classification model with one label when
            ``value_head``), possibly FSDP-sharded.
        micro: ``input_ids``, ``attention_mask``, ``responses`` (or ``response_mask``:
            only the responses' width is read) and optionally ``position_ids`` (verl's
            layout, see `rayrl.train.packing`).
        packed: drop padding and pack the sequences into one row (a micro-batch with
            no padding runs unpacked: the same result with fewer steps).
        value_head: return ``values`` (the head's output at the position before each
            response token, i.e. the state the token is chosen in).
        temperature: logits are divided by it before the softmax.
        with_entropy: also return ``entropy``.
        chunk_size: tokens per chunk of the log-softmax.
        device: where the model runs.
        sp: the Ulysses group of a sequence-parallel model: the micro-batch is packed
            and this rank runs its share of the row (`rayrl.train.ulysses`); every
            rank of the group returns the whole micro-batch's outputs.
        share_prompts: rows with the same prompt (GRPO's samples of one prompt) run
            it once, packed with their responses (`rayrl.train.shared_prompts`); not
            with ``sp``.
        vision: a vision-language model's image side (`rayrl.train.vision_inputs`):
            the rows' ``multi_modal_inputs`` spliced into their prompts; not with
            ``sp`` or ``share_prompts``.
        aux_loss: also return the router's load-balancing loss of a mixture-of-experts
            model whose config enables router logits, a scalar under
            `rayrl.train.moe_aux.AUX_KEY` (`rayrl.train.moe_aux`); not with ``sp``.
        with_sum_pi_squared: also return ``sum_pi_squared``: sum over the vocabulary
            of ``softmax(logits / temperature)^2`` at each response token (no gradient).

    Returns:
        ``{"log_probs": ..., "entropy": ..., "sum_pi_squared": ...}`` (the last two
        when asked for) or ``{"values": ...}``, each ``[b, R]``.
    """
    device = torch.device(device) if device is not None else micro["input_ids"].device
    if vision is not None and (sp is not None or share_prompts):
        raise ValueError(
            "a vision-language model's micro-batches run neither sequence-parallel nor "
            "with shared prompts (their images would be split, or run once per prompt); "
            "set ulysses_sequence_parallel_size=1 and model.share_prompts=false"
        )
    wanted = _Wanted(temperature, with_entropy, chunk_size, with_sum_pi_squared)
    if sp is not None:
        return _sequence_parallel_outputs(model, micro, sp, value_head, wanted, device)
    # A micro-batch without padding gains nothing from packing: run its rows as they are.
    packed = packed and not bool(micro["attention_mask"].bool().all())
    inputs, index, packed, where = _model_inputs(micro, packed, device, share_prompts, vision)
    replay = active_routing(model)  # routing replay (`rayrl.train.router_replay`)
    if replay is not None:
        replay.feed(micro, where, inputs["input_ids"].numel(), device)
    if value_head:
        scores = model(**inputs, use_cache=False).logits[..., 0]
        picked = scores[0, index.logit_index] if packed else scores[:, index.logit_index]
        return {"values": _place(picked, index, packed)}
    labels = index.labels if packed else index.labels.clamp(min=0)  # pads may be negative
    columns, aux = _token_log_probs(model, inputs, index.logit_index, labels, packed, wanted)
    result = {key: _place(values, index, packed) for key, values in columns.items()}
    if aux_loss and aux is not None:
        result[AUX_KEY] = aux
    if replay is not None:
        result.update(replay.outputs(micro, where))
    return result


@dataclass(frozen=True)
class _Wanted:
    """What the log-prob head computes besides the label log-probs, and how."""

    temperature: float
    with_entropy: bool
    chunk_size: int
    with_sum_pi_squared: bool

    @property
    def keys(self) -> tuple[str, ...]:
        """The output columns, in order."""
        keys = ["log_probs"]
        if self.with_entropy:
            keys.append("entropy")
        if self.with_sum_pi_squared:
            keys.append("sum_pi_squared")
        return tuple(keys)


def _token_log_probs(
    model: nn.Module,
    inputs: dict[str, Tensor],
    keep: Tensor,
    labels: Tensor,
    packed: bool,
    wanted: _Wanted,
) -> tuple[dict[str, Tensor], Tensor | None]:
    """Log-probs of ``labels`` (and what else ``wanted`` names) at the kept positions,
    each shaped like ``labels``, by ``wanted.keys``; and the forward's router aux loss
    (None unless the model returns one)."""
    t, chunk = wanted.temperature, wanted.chunk_size
    head = logprob_head_of(model)
    if head is not None:  # fused: no [tokens x vocab] logits
        target = labels.reshape(1, -1) if packed else labels
        with head.requested(target, t, wanted.with_entropy, chunk, wanted.with_sum_pi_squared):
            result = model(**inputs, use_cache=False, logits_to_keep=keep)
        out = result.logits[0] if packed else result.logits
        columns = {"log_probs": out[..., 0], "entropy": out[..., 1]}
        if wanted.with_sum_pi_squared:
            columns["sum_pi_squared"] = out[..., 2]
        return {key: columns[key] for key in wanted.keys}, getattr(result, "aux_loss", None)
    result = model(**inputs, use_cache=False, logits_to_keep=keep)
    logits = result.logits[0] if packed else result.logits
    if wanted.with_entropy:
        log_probs, entropy = log_probs_and_entropy(logits, labels, t, chunk)
        columns = {"log_probs": log_probs, "entropy": entropy}
    else:
        columns = {"log_probs": log_probs_from_logits(logits, labels, t, chunk)}
    if wanted.with_sum_pi_squared:
        columns["sum_pi_squared"] = sum_pi_squared_from_logits(logits, t, chunk)
    return columns, getattr(result, "aux_loss", None)


def _sequence_parallel_outputs(
    model: nn.Module,
    micro: Batch,
    sp: SPGroup,
    value_head: bool,
    wanted: _Wanted,
    device: torch.device,
) -> dict[str, Tensor]:
    """`response_outputs` on a Ulysses rank: the packed row split (`split_packed`), this
    rank's kept positions through the model and the head, every rank's gathered."""
    if active_routing(model) is not None:
        raise ValueError(
            "routing replay does not run with Ulysses sequence parallelism yet; set "
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=1, or turn "
            "router_replay.mode and rollout.enable_rollout_routing_replay off"
        )
    ids, mask = micro["input_ids"], micro["attention_mask"]
    positions = micro["position_ids"] if "position_ids" in micro else default_position_ids(mask)
    packed = pack_sequences(ids, mask, positions, response_width(micro))
    lengths = [n for n in mask.sum(dim=1).tolist() if n > 0]
    part = split_packed(
        packed.input_ids, packed.position_ids, lengths, packed.response.logit_index, sp
    )
    inputs = {
        "input_ids": part.input_ids.to(device, non_blocking=True),
        "position_ids": part.position_ids.to(device, non_blocking=True),
        **packed_attention_kwargs(part.lengths, device),
    }
    index = ResponseIndex(
        valid=packed.response.valid.to(device, non_blocking=True),
        logit_index=packed.response.logit_index.to(device, non_blocking=True),
        labels=packed.response.labels,
    )
    if value_head:
        scores = model(**inputs, use_cache=False).logits[0, :, 0]
        row = gather_kept(scores, [scores.shape[0]] * sp.size, sp)
        return {"values": _place(row[index.logit_index], index, packed=True)}
    keep = part.keep.to(device, non_blocking=True)
    labels = packed.response.labels[part.keep_mask].to(device, non_blocking=True)
    columns, _ = _token_log_probs(model, inputs, keep, labels, True, wanted)
    every = gather_kept(torch.stack(list(columns.values()), dim=-1), part.counts, sp)
    return {key: _place(every[:, i], index, packed=True) for i, key in enumerate(columns)}
