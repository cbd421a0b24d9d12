"""Token log-probs and entropy from logits, in chunks so memory stays bounded.

At a 150k vocabulary, a float32 softmax over 8k tokens is ~5 GB, and autograd would
keep several such tensors alive for the backward pass. Here the forward pass walks the
flattened tokens ``chunk_size`` rows at a time and keeps only per-token scalars (the
log-normaliser); the backward pass recomputes each chunk's softmax to write the
gradient. Each chunk works in place on at most two ``chunk_size x vocab`` buffers, so
with the default 512-token chunk at a 151,936 vocabulary the extra memory is about
0.6 GB however many tokens there are. The math is done in float32 (float64 for float64
logits); the gradient comes back in the logits' dtype.

For logits ``z`` scaled by ``1 / temperature``, ``p = softmax(z)``:

- ``log p(y) = z_y - logsumexp(z)``, gradient ``(onehot(y) - p) / temperature``;
- ``H = logsumexp(z) - sum(p z)``, gradient ``-p (log p + H) / temperature``;
- ``sum p^2 = exp(logsumexp(2 z) - 2 logsumexp(z))`` (`sum_pi_squared_from_logits`, no
  gradient: the optimal token baseline reads it from the log-prob pass).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

__all__ = [
    "entropy_from_logits",
    "log_probs_and_entropy",
    "log_probs_from_logits",
    "logit_grad_",
    "sum_pi_squared_from_logits",
]

DEFAULT_CHUNK = 512


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _LogProbEntropy(torch.autograd.Function):
    """Chunked log p(label) and entropy over flattened ``[tokens, vocab]`` logits.

    Each chunk works in place on at most two ``chunk x vocab`` buffers.
    """

    @staticmethod
    def forward(
        ctx: Any,
        logits: Tensor,
        labels: Tensor,
        temperature: float,
        chunk_size: int,
        with_entropy: bool,
    ) -> tuple[Tensor, Tensor]:
        dtype = _compute_dtype(logits.dtype)
        n = logits.shape[0]
        logp = torch.empty(n, dtype=dtype, device=logits.device)
        ent = torch.zeros(n, dtype=dtype, device=logits.device)
        # log-normaliser = peak + lse: kept apart so large logits do not cancel.
        peak = torch.empty(n, dtype=dtype, device=logits.device)
        lse = torch.empty(n, dtype=dtype, device=logits.device)
        for start in range(0, n, chunk_size):
            rows = slice(start, start + chunk_size)
            z = _scaled_chunk(logits, rows, dtype, temperature)
            peak[rows] = z.amax(dim=-1)
            z.sub_(peak[rows].unsqueeze(-1))
            p = torch.exp(z)
            total = p.sum(dim=-1)
            lse[rows] = total.log()
            logp[rows] = z.gather(-1, labels[rows].unsqueeze(-1)).squeeze(-1) - lse[rows]
            if with_entropy:
                p.div_(total.unsqueeze(-1)).mul_(z)
                ent[rows] = lse[rows] - p.sum(dim=-1)
        ctx.save_for_backward(logits, labels, peak, lse, ent)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.with_entropy = with_entropy
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    @once_differentiable  # type: ignore[untyped-decorator]  # torch is not followed
    def backward(
        ctx: Any, grad_logp: Tensor | None, grad_ent: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        logits, labels, peak, lse, ent = ctx.saved_tensors
        dtype = lse.dtype
        grad = torch.empty_like(logits)
        if not ctx.with_entropy:
            grad_ent = None
        for start in range(0, logits.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            log_p = _scaled_chunk(logits, rows, dtype, ctx.temperature)
            log_p.sub_(peak[rows].unsqueeze(-1)).sub_(lse[rows].unsqueeze(-1))
            grad[rows] = logit_grad_(
                log_p,
                labels[rows],
                ctx.temperature,
                grad_logp=None if grad_logp is None else grad_logp[rows],
                ent=None if grad_ent is None else ent[rows],
                grad_ent=None if grad_ent is None else grad_ent[rows],
            )
        return grad, None, None, None, None


def logit_grad_(
    log_p: Tensor,
    labels: Tensor,
    temperature: float,
    *,
    grad_logp: Tensor | None,
    ent: Tensor | None = None,
    grad_ent: Tensor | None = None,
) -> Tensor:
    """The gradient with respect to the (unscaled) logits of one chunk of tokens.

    ``log_p`` is the chunk's ``[rows, vocab]`` normalised log-softmax at ``temperature``
    and is overwritten (the result reuses its memory). ``grad_logp`` / ``grad_ent`` are
    the incoming gradients of the label log-probs and of the entropies ``ent`` (None:
    zero). ``g = -p (g_logp + g_ent (log p + H)) + onehot(label) g_logp``, over
    ``temperature``.
    """
    g_lp = (
        grad_logp.to(log_p.dtype).unsqueeze(-1)
        if grad_logp is not None
        else log_p.new_zeros(log_p.shape[0], 1)
    )
    if ent is not None and grad_ent is not None:
        p = torch.exp(log_p)
        g = log_p.add_(ent.unsqueeze(-1))
        g.mul_(grad_ent.to(log_p.dtype).unsqueeze(-1)).add_(g_lp).mul_(p)
        del p
    else:
        g = log_p.exp_().mul_(g_lp)
    g.neg_().scatter_add_(-1, labels.unsqueeze(-1), g_lp)
    if temperature != 1.0:
        g.div_(temperature)
    return g


def _scaled_chunk(logits: Tensor, rows: slice, dtype: torch.dtype, temperature: float) -> Tensor:
    """A fresh ``dtype`` copy of ``logits[rows] / temperature`` that may be modified."""
    z = logits[rows].to(dtype, copy=True)
    return z.div_(temperature) if temperature != 1.0 else z


def _run(
    logits: Tensor, labels: Tensor, temperature: float, chunk_size: int, with_entropy: bool
) -> tuple[Tensor, Tensor]:
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels {tuple(labels.shape)} must match the logits' leading dims "
            f"{tuple(logits.shape[:-1])}"
        )
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    logp, ent = _LogProbEntropy.apply(
        flat, labels.reshape(-1).long(), float(temperature), int(chunk_size), with_entropy
    )
    return logp.reshape(lead), ent.reshape(lead)


def log_probs_and_entropy(
    logits: Tensor, labels: Tensor, temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK
) -> tuple[Tensor, Tensor]:
    """Log-prob of ``labels`` and entropy of the distribution, both shaped like ``labels``.

    Args:
        logits: ``[..., vocab]``, any float dtype.
        labels: ``[...]`` token ids, valid indices everywhere (mask padding afterwards).
        temperature: logits are divided by it (the sampling temperature).
        chunk_size: tokens processed at once.
    """
    return _run(logits, labels, temperature, chunk_size, with_entropy=True)


def log_probs_from_logits(
    logits: Tensor, labels: Tensor, temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK
) -> Tensor:
    """Log-prob of ``labels`` under ``softmax(logits / temperature)``, shaped like ``labels``."""
    return _run(logits, labels, temperature, chunk_size, with_entropy=False)[0]


def entropy_from_logits(
    logits: Tensor, temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK
) -> Tensor:
    """Entropy of ``softmax(logits / temperature)`` over the last dim, shape ``[...]``."""
    labels = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    return _run(logits, labels, temperature, chunk_size, with_entropy=True)[1]


@torch.no_grad()  # type: ignore[untyped-decorator]  # torch is not followed
def sum_pi_squared_from_logits(
    logits: Tensor, temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK
) -> Tensor:
    """``sum_v softmax(logits / temperature)_v^2`` over the last dim, shape ``[...]``, in
    float32 (float64 for float64 logits), chunk by chunk; no gradient."""
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    flat = logits.reshape(-1, logits.shape[-1])
    dtype = _compute_dtype(logits.dtype)
    out = torch.empty(flat.shape[0], dtype=dtype, device=logits.device)
    for start in range(0, flat.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        z = _scaled_chunk(flat, rows, dtype, temperature)
        log_norm = torch.logsumexp(z, dim=-1)
        out[rows] = torch.exp(torch.logsumexp(z.mul_(2), dim=-1) - 2 * log_norm)
    return out.reshape(logits.shape[:-1])
