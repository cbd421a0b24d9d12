"""Token log-probs and entropy straight from hidden states: the output projection and
the log-softmax fused chunk by chunk, so ``[tokens x vocab]`` logits never exist whole.

At a 152k vocabulary, 512 x 512 response tokens would need ~80 GB of bf16 logits, and
autograd would keep them (and their gradient) for the backward pass. `LogProbHead`
replaces a causal LM's ``lm_head`` (same weight Parameter, same state-dict name, still
tied to the embedding where it was): called normally it is the plain linear layer
(generation, HF export); inside ``with head.requested(labels, temperature, ...)`` it
returns, in place of logits, ``[..., 2]``: the log-prob of each label and the entropy.

`_FusedLogProbs` walks the tokens ``chunk_size`` rows at a time: each chunk's logits are
computed (matmul in the compute dtype: autocast's or the weight's), divided by the
temperature in float32, reduced to the label's log-prob, the log-normaliser and the
entropy, and dropped. Only the hidden states, the weight and three floats per token
are kept. The backward pass recomputes each chunk's logits and writes the gradients
of the hidden states and of the weight; the extra cost is one more projection matmul.

For logits ``z`` (already divided by the temperature ``T``), ``p = softmax(z)``:
``log p(y) = z_y - logsumexp(z)``, ``H = logsumexp(z) - sum(p z)``; the gradient with
respect to ``z`` is ``g_lp (onehot(y) - p) - g_H p (log p + H)``, then ``/ T``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from rayrl.algos.entropy import logit_grad_

__all__ = ["LogProbHead", "install_logprob_head", "logprob_head_of"]


@dataclass
class _Request:
    labels: Tensor
    temperature: float
    with_entropy: bool
    chunk_size: int


class LogProbHead(nn.Linear):
    """An ``nn.Linear`` output head that can return label log-probs and entropy."""

    _request: _Request | None = None
    chunk_math: ChunkMath | None = None  # None: eager (`EAGER`)

    @contextmanager
    def requested(
        self, labels: Tensor, temperature: float, with_entropy: bool, chunk_size: int
    ) -> Iterator[None]:
        """Inside, a call on hidden states ``[..., H]`` (with ``labels`` ``[...]``)
        returns ``[..., 2]``: log p(label) and the entropy (0 without ``with_entropy``)."""
        if temperature <= 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self._request = _Request(labels, float(temperature), with_entropy, int(chunk_size))
        try:
            yield
        finally:
            self._request = None

    def forward(self, hidden: Tensor) -> Tensor:
        request = self._request
        if request is None:
            return super().forward(hidden)
        if request.labels.shape != hidden.shape[:-1]:
            raise ValueError(
                f"labels {tuple(request.labels.shape)} must match the hidden states' leading "
                f"dims {tuple(hidden.shape[:-1])}"
            )
        device = hidden.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
        else:
            dtype = self.weight.dtype
        flat = hidden.reshape(-1, hidden.shape[-1]).to(dtype)
        weight = self.weight.to(dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        logp, ent = _FusedLogProbs.apply(
            flat, weight, bias, request.labels.reshape(-1).long(),
            request.temperature, request.chunk_size, request.with_entropy,
            self.chunk_math or EAGER,
        )  # fmt: skip
        return torch.stack([logp, ent], dim=-1).reshape(*hidden.shape[:-1], 2)


def install_logprob_head(model: nn.Module) -> LogProbHead | None:
    """Swap the model's linear output head for a `LogProbHead` sharing its parameters.

    Returns the head, or None when the model's output embeddings are not a plain linear
    layer (then callers compute log-probs from logits).
    """
    old = model.get_output_embeddings()
    if isinstance(old, LogProbHead):
        return old
    if type(old) is not nn.Linear:
        return None
    head = LogProbHead(old.in_features, old.out_features, bias=old.bias is not None, device="meta")
    head.weight = old.weight  # the same Parameter: tying and state-dict names unchanged
    if old.bias is not None:
        head.bias = old.bias
    model.set_output_embeddings(head)
    return head


def logprob_head_of(model: nn.Module) -> LogProbHead | None:
    """The model's `LogProbHead`, if `install_logprob_head` put one there."""
    head = model.get_output_embeddings()
    return head if isinstance(head, LogProbHead) else None


def _chunk_logits(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: float
) -> Tensor:
    """``logits / temperature`` of a chunk of hidden states, in float32 (float64 for
    float64 inputs), fresh."""
    z = F.linear(hidden, weight, bias)
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    return z.div_(temperature) if temperature != 1.0 else z


def forward_chunk(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    labels: Tensor,
    temperature: float,
    with_entropy: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """One chunk's ``(log p(label), log-normaliser, entropy)`` (entropy 0 without
    ``with_entropy``), each ``[rows]`` in the logits' float dtype."""
    z = _chunk_logits(hidden, weight, bias, temperature)
    log_norm = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - log_norm
    if with_entropy:
        ent = log_norm - (torch.softmax(z, dim=-1) * z).sum(dim=-1)
    else:
        ent = torch.zeros_like(log_norm)
    return logp, log_norm, ent


def backward_chunk(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    labels: Tensor,
    log_norm: Tensor,
    temperature: float,
    grad_logp: Tensor | None,
    ent: Tensor | None,
    grad_ent: Tensor | None,
) -> Tensor:
    """The gradient with respect to one chunk's (unscaled) logits, in ``hidden``'s
    dtype, from the logits recomputed."""
    log_p = _chunk_logits(hidden, weight, bias, temperature)
    log_p.sub_(log_norm.unsqueeze(-1))
    g = logit_grad_(log_p, labels, temperature, grad_logp=grad_logp, ent=ent, grad_ent=grad_ent)
    return g.to(hidden.dtype)


def _accumulate_matmul(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc += a @ b`` with ``acc`` in float32 and ``a``, ``b`` in a half dtype: on
    CUDA one cuBLAS call that adds the float32 product into ``acc`` (no half-precision
    product, no cast, no separate add: at a 152k vocabulary those three passes over the
    ``[vocab x hidden]`` gradient took ~0.1 s of a 2 s update, once per chunk);
    elsewhere, the product cast and added."""
    if acc.is_cuda and a.dtype != acc.dtype:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc += (a @ b).to(acc.dtype)


@dataclass(frozen=True)
class ChunkMath:
    """The per-chunk functions `_FusedLogProbs` calls: eager by default, or compiled
    versions of the same (`rayrl.engines.regional_compile`)."""

    forward: Any = forward_chunk
    backward: Any = backward_chunk


EAGER = ChunkMath()


class _FusedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        labels: Tensor,
        temperature: float,
        chunk_size: int,
        with_entropy: bool,
        math: ChunkMath = EAGER,
    ) -> tuple[Tensor, Tensor]:
        n, dtype = hidden.shape[0], torch.promote_types(hidden.dtype, torch.float32)
        logp = torch.empty(n, dtype=dtype, device=hidden.device)
        ent = torch.zeros(n, dtype=dtype, device=hidden.device)
        log_norm = torch.empty(n, dtype=dtype, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, n, chunk_size):
                rows = slice(start, start + chunk_size)
                logp[rows], log_norm[rows], ent[rows] = math.forward(
                    hidden[rows], weight, bias, labels[rows], temperature, with_entropy
                )
        ctx.save_for_backward(hidden, weight, bias, labels, log_norm, ent)
        ctx.temperature, ctx.chunk_size, ctx.with_entropy = temperature, chunk_size, with_entropy
        ctx.math = math
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_logp: Tensor | None, grad_ent: Tensor | None) -> tuple:
        hidden, weight, bias, labels, log_norm, ent = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        acc = log_norm.dtype  # float32, or float64 for float64 inputs
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[:1], dtype=acc, device=weight.device) if need_b else None
        use_ent = ctx.with_entropy and grad_ent is not None
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], ctx.chunk_size):
                rows = slice(start, start + ctx.chunk_size)
                g = ctx.math.backward(
                    hidden[rows], weight, bias, labels[rows], log_norm[rows], ctx.temperature,
                    None if grad_logp is None else grad_logp[rows],
                    ent[rows] if use_ent else None, grad_ent[rows] if use_ent else None,
                )  # fmt: skip
                if need_h:
                    grad_h[rows] = g @ weight
                if need_w:
                    _accumulate_matmul(grad_w, g.t(), hidden[rows])
                if need_b:
                    grad_b += g.to(acc).sum(dim=0)
        grad_w = grad_w.to(weight.dtype) if need_w else None
        grad_b = grad_b.to(bias.dtype) if need_b else None
        return grad_h, grad_w, grad_b, None, None, None, None, None
