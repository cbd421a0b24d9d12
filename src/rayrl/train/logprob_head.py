"""Token log-probs and entropy straight from hidden states: the output projection and
the log-softmax fused chunk by chunk, so no float32 ``[tokens x vocab]`` logits (nor
their gradient) exist whole.

At a 152k vocabulary, 512 x 512 response tokens would need ~80 GB of bf16 logits, and
autograd would keep them (and their gradient) for the backward pass. `LogProbHead`
replaces a causal LM's ``lm_head`` (same weight Parameter, same state-dict name, still
tied to the embedding where it was): called normally it is the plain linear layer
(generation, HF export); inside ``with head.requested(labels, temperature, ...)`` it
returns, in place of logits, ``[..., 2]``: the log-prob of each label and the entropy;
with ``with_sum_pi_squared`` ``[..., 3]``: also each token's sum over the vocabulary of
the squared probabilities (verl's ``sum_pi_squared``, which the optimal token baseline
reads), without a gradient.
A model whose forward changes the head's output before it returns it (Granite's
``logits_scaling``, Gemma 2 and 3's final soft-cap) keeps its linear head
(`changes_logits`): its log-probs come from its logits.

`_FusedLogProbs` walks the tokens ``chunk_size`` rows at a time: each chunk's logits are
computed (matmul in the compute dtype: autocast's or the weight's), divided by the
temperature in float32, reduced to the label's log-prob, the log-normaliser and the
entropy. The backward pass needs each chunk's logits again: the forward keeps them, as
the projection gave them (bf16 on a GPU), where memory allows (`keep_logits`: 10 GB
for a micro-batch of 32k response tokens at a 152k vocabulary, on an H200 with room);
otherwise it keeps only the hidden states, the weight and three floats per token, and
the backward recomputes each chunk's logits (one more projection matmul). Either way
it writes the gradients of the hidden states and of the weight.

For logits ``z`` (already divided by the temperature ``T``), ``p = softmax(z)``:
``log p(y) = z_y - logsumexp(z)``, ``H = logsumexp(z) - sum(p z)``,
``sum p^2 = exp(logsumexp(2 z) - 2 logsumexp(z))``; the gradient with respect to ``z``
is ``g_lp (onehot(y) - p) - g_H p (log p + H)``, then ``/ T``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from rayrl.algos.entropy import logit_grad_

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = [
    "LogProbHead",
    "changes_logits",
    "install_logprob_head",
    "keep_logits",
    "logprob_head_of",
]

# The forward keeps the logits for the backward when they fit this share of the free
# device memory (`keep_logits`), or, in host memory, this many bytes.
KEEP_LOGITS_SHARE = 0.25
KEEP_LOGITS_HOST_BYTES = 256 * 2**20


@dataclass
class _Request:
    labels: Tensor
    temperature: float
    with_entropy: bool
    chunk_size: int
    with_sum_pi_squared: bool = False


class LogProbHead(nn.Linear):
    """An ``nn.Linear`` output head that can return label log-probs and entropy."""

    _request: _Request | None = None
    chunk_math: ChunkMath | None = None  # None: eager (`EAGER`)

    @contextmanager
    def requested(
        self,
        labels: Tensor,
        temperature: float,
        with_entropy: bool,
        chunk_size: int,
        with_sum_pi_squared: bool = False,
    ) -> Iterator[None]:
        """Inside, a call on hidden states ``[..., H]`` (with ``labels`` ``[...]``)
        returns ``[..., 2]``: log p(label) and the entropy (0 without ``with_entropy``);
        with ``with_sum_pi_squared``, ``[..., 3]``: and sum p^2 (no gradient)."""
        if temperature <= 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self._request = _Request(
            labels, float(temperature), with_entropy, int(chunk_size), with_sum_pi_squared
        )
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
        grad = torch.is_grad_enabled() and (flat.requires_grad or weight.requires_grad)
        nbytes = flat.shape[0] * weight.shape[0] * weight.element_size()
        logp, ent, squares = _FusedLogProbs.apply(
            flat,
            weight,
            bias,
            request.labels.reshape(-1).long(),
            request.temperature,
            request.chunk_size,
            request.with_entropy,
            self.chunk_math or EAGER,
            grad and keep_logits(nbytes, hidden.device),
            request.with_sum_pi_squared,
        )
        columns = [logp, ent, squares] if request.with_sum_pi_squared else [logp, ent]
        return torch.stack(columns, dim=-1).reshape(*hidden.shape[:-1], len(columns))


def keep_logits(nbytes: int, device: torch.device) -> bool:
    """Whether the forward keeps its logits (``nbytes`` in all) for the backward, which
    then does not project again: on CUDA when they take at most `KEEP_LOGITS_SHARE` of
    the memory free now (the driver's free memory plus the allocator's unused cache),
    elsewhere up to `KEEP_LOGITS_HOST_BYTES`. At the reference shape the second
    projection is about 5% of the update's FLOPs (not counted as useful work)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        keep: bool = nbytes <= KEEP_LOGITS_SHARE * (free + cached)
        return keep
    return nbytes <= KEEP_LOGITS_HOST_BYTES


def install_logprob_head(model: nn.Module) -> LogProbHead | None:
    """Swap the model's linear output head for a `LogProbHead` sharing its parameters.

    Returns the head, or None when the model's output embeddings are not a plain linear
    layer, or when its forward changes the head's output before returning it as logits
    (`changes_logits`): then callers compute log-probs from logits.
    """
    old = model.get_output_embeddings()
    if isinstance(old, LogProbHead):
        return old
    if type(old) is not nn.Linear or changes_logits(model.config):
        return None
    head = LogProbHead(old.in_features, old.out_features, bias=old.bias is not None, device="meta")
    head.weight = old.weight  # the same Parameter: tying and state-dict names unchanged
    if old.bias is not None:
        head.bias = old.bias
    model.set_output_embeddings(head)
    return head


def changes_logits(config: PretrainedConfig) -> bool:
    """The model's forward transforms the head's output (Granite divides it by
    ``logits_scaling``, Gemma 2 and 3 soft-cap it by ``final_logit_softcapping``): it
    would do the same to a fused head's log-probs."""
    scaling = getattr(config, "logits_scaling", None)
    return bool(getattr(config, "final_logit_softcapping", None)) or scaling not in (None, 1.0)


def logprob_head_of(model: nn.Module) -> LogProbHead | None:
    """The model's `LogProbHead`, if `install_logprob_head` put one there."""
    head = model.get_output_embeddings()
    return head if isinstance(head, LogProbHead) else None


def _scaled(logits: Tensor, temperature: float, fresh: bool) -> Tensor:
    """``logits / temperature`` in float32 (float64 for float64 logits); ``fresh``: the
    logits are this call's own, so float32 ones may be scaled in place (else a kept
    float32 tensor would change under its keeper)."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature == 1.0:
        return z
    return z.div_(temperature) if fresh or z is not logits else z / temperature


def forward_chunk(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    labels: Tensor,
    temperature: float,
    with_entropy: bool,
    keep_logits: bool = False,
    with_sum_pi_squared: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """One chunk's ``(log p(label), log-normaliser, entropy, sum p^2, logits)``
    (entropy 0 without ``with_entropy``), each ``[rows]`` in the logits' float dtype;
    sum p^2 only with ``with_sum_pi_squared`` and the logits (the projection's output,
    unscaled) only with ``keep_logits``, else None."""
    raw = F.linear(hidden, weight, bias)
    z = _scaled(raw, temperature, fresh=not keep_logits)
    log_norm = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - log_norm
    if with_entropy:
        ent = log_norm - (torch.softmax(z, dim=-1) * z).sum(dim=-1)
    else:
        ent = torch.zeros_like(log_norm)
    squares = None
    if with_sum_pi_squared:  # log sum_v p_v^2 = logsumexp(2 z) - 2 logsumexp(z)
        squares = torch.exp(torch.logsumexp(z * 2, dim=-1) - 2 * log_norm)
    return logp, log_norm, ent, squares, (raw if keep_logits else None)


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
    logits: Tensor | None = None,
) -> Tensor:
    """The gradient with respect to one chunk's (unscaled) logits, in ``hidden``'s
    dtype, from the ``logits`` the forward kept (used up: scaled in place when they
    are float32) or, without them, recomputed."""
    raw = F.linear(hidden, weight, bias) if logits is None else logits
    log_p = _scaled(raw, temperature, fresh=True)
    log_p.sub_(log_norm.unsqueeze(-1))
    g = logit_grad_(log_p, labels, temperature, grad_logp=grad_logp, ent=ent, grad_ent=grad_ent)
    return g.to(hidden.dtype)


def _accumulate_matmul(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc += a @ b`` with ``acc`` in float32 and ``a``, ``b`` in a half dtype: on
    CUDA one cuBLAS call that adds the float32 product into ``acc`` (no half-precision
    product, no cast, no separate add: three passes over the ``[vocab x hidden]``
    gradient per chunk, a visible share of an update at a 152k vocabulary:
    docs/benchmarks.md);
    elsewhere, the product cast and added."""
    if acc.is_cuda and a.dtype != acc.dtype:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc += (a @ b).to(acc.dtype)


@dataclass(frozen=True)
class ChunkMath:
    """The per-chunk functions `_FusedLogProbs` calls: eager by default, or compiled
    versions of the same (`rayrl.train.regional_compile`)."""

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
        keep_logits: bool = False,
        with_sum_pi_squared: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor]:
        n, dtype = hidden.shape[0], torch.promote_types(hidden.dtype, torch.float32)
        logp = torch.empty(n, dtype=dtype, device=hidden.device)
        ent = torch.zeros(n, dtype=dtype, device=hidden.device)
        log_norm = torch.empty(n, dtype=dtype, device=hidden.device)
        # sum p^2 has no gradient: empty unless asked for
        squares = torch.zeros(n if with_sum_pi_squared else 0, dtype=dtype, device=hidden.device)
        ctx.kept = []  # each chunk's logits for the backward, with ``keep_logits``
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, n, chunk_size):
                rows = slice(start, start + chunk_size)
                logp[rows], log_norm[rows], ent[rows], chunk_squares, raw = math.forward(
                    hidden[rows],
                    weight,
                    bias,
                    labels[rows],
                    temperature,
                    with_entropy,
                    keep_logits,
                    with_sum_pi_squared,
                )
                if chunk_squares is not None:
                    squares[rows] = chunk_squares
                ctx.kept.append(raw)
        ctx.save_for_backward(hidden, weight, bias, labels, log_norm, ent)
        ctx.temperature, ctx.chunk_size, ctx.with_entropy = temperature, chunk_size, with_entropy
        ctx.math = math
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        ctx.mark_non_differentiable(squares)
        return logp, ent, squares

    @staticmethod
    @once_differentiable  # type: ignore[untyped-decorator]  # torch is not followed
    def backward(
        ctx: Any, grad_logp: Tensor | None, grad_ent: Tensor | None, _grad_squares: Any
    ) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, labels, log_norm, ent = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        acc = log_norm.dtype  # float32, or float64 for float64 inputs
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[:1], dtype=acc, device=weight.device) if need_b else None
        ent_grad = grad_ent if ctx.with_entropy else None  # None: no entropy gradient
        with torch.autocast(hidden.device.type, enabled=False):
            for i, start in enumerate(range(0, hidden.shape[0], ctx.chunk_size)):
                rows = slice(start, start + ctx.chunk_size)
                logits, ctx.kept[i] = ctx.kept[i], None  # freed as the backward goes
                g = ctx.math.backward(
                    hidden[rows],
                    weight,
                    bias,
                    labels[rows],
                    log_norm[rows],
                    ctx.temperature,
                    None if grad_logp is None else grad_logp[rows],
                    None if ent_grad is None else ent[rows],
                    None if ent_grad is None else ent_grad[rows],
                    logits,
                )
                if grad_h is not None:
                    grad_h[rows] = g @ weight
                if grad_w is not None:
                    _accumulate_matmul(grad_w, g.t(), hidden[rows])
                if grad_b is not None:
                    grad_b += g.to(acc).sum(dim=0)
        out_w = None if grad_w is None else grad_w.to(weight.dtype)
        out_b = None if grad_b is None else grad_b.to(bias.dtype)
        return grad_h, out_w, out_b, None, None, None, None, None, None, None
