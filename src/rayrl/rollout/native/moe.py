"""The native engine's mixture-of-experts MLP: a router picks experts, the chosen ones run.

`moe_mlp` is a layer's MLP where its `MoESpec` says so (Qwen2-MoE, Qwen3-MoE, Mixtral):

- **routing** (`route`), as transformers computes it: router logits in the model dtype,
  softmax in float32, the top ``k`` probabilities, renormalised to sum to 1 where the
  family or config says (``norm_topk``: Mixtral always, Qwen's ``norm_topk_prob``), then
  rounded to the model dtype (Qwen) or kept in float32 (Mixtral, whose experts' outputs
  are scaled in float32 and rounded after);
- **experts**: each token's chosen experts (SwiGLU, or the family's gated activation),
  each output scaled by its routing weight, summed. Three ways, one result:

  - ``reference`` (CPU, and the reference the others are tested against): a loop over
    the experts some token chose, each running on its tokens (``index_select``, then
    ``index_add``), as transformers loops; its shapes depend on the routing and it asks
    the host which experts were chosen, so it is never captured in a CUDA graph;
  - ``grouped`` (CUDA, where ``torch._grouped_mm`` runs on the device and dtype: bf16,
    Hopper or later): the token-expert pairs sorted by expert, a fixed ``T * k`` rows,
    two grouped matmuls over the experts' row ranges (the offsets stay on the device),
    the rows put back in token order and each token's ``k`` rows summed. No host sync
    and no shape depends on the routing, so decode and small prefill steps are captured
    in CUDA graphs as the dense MLP is;
  - ``dense`` (CUDA without a working grouped matmul): every expert runs on every token
    (a loop over all experts, static), its output scaled by the token's routing weight
    for it, zero where it was not chosen. Graph-safe too, at ``experts / k`` times the
    compute: a fallback, not a fast path.

- a **shared expert** (Qwen2-MoE), a dense MLP on every token in the layer's
  ``gate_up`` / ``down`` slots, scaled by ``sigmoid(x @ shared_gate)``, added.

Tensor-parallel, each rank holds a slice of every expert's intermediate width (gate and
up rows, down columns) and of the shared expert's; the router and the shared expert's
gate are whole on every rank. The op then returns the rank's partial sum, and the model
all-reduces it as it does the dense MLP's down projection.

`moe_mlp` returns the top-k expert indices of every token beside the output, for a
caller that wants to record the routing (nothing here keeps them).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from rayrl.rollout.native.spec import MoESpec

__all__ = ["EXPERT_PATHS", "expert_path", "grouped_mm_works", "moe_mlp", "route"]

Act = Callable[[Tensor], Tensor]  # [rows, 2 * width] gate|up -> [rows, width]


def moe_mlp(x: Tensor, layer, spec: MoESpec, act: Act, path: str) -> tuple[Tensor, Tensor]:
    """``(output [T, hidden], top-k expert indices [T, k])`` of layer ``layer``'s mixture
    of experts (`rayrl.rollout.native.weights.LayerWeights`'s ``router``,
    ``experts_gate_up``, ``experts_down``, and ``gate_up``, ``down``, ``shared_gate``
    of the shared expert where it has one), ``path`` one of `EXPERT_PATHS`."""
    weights, chosen = route(x, layer.router, spec)
    out = EXPERT_PATHS[path](x, layer.experts_gate_up, layer.experts_down, weights, chosen, act)
    if layer.gate_up is not None:  # the shared expert
        shared = F.linear(act(F.linear(x, layer.gate_up)), layer.down)
        if layer.shared_gate is not None:
            shared = torch.sigmoid(F.linear(x, layer.shared_gate)) * shared
        out = out + shared
    return out, chosen


def route(x: Tensor, router: Tensor, spec: MoESpec) -> tuple[Tensor, Tensor]:
    """``(routing weights [T, k], expert indices [T, k])``: softmax over the experts in
    float32, top-k, renormalised where ``spec.norm_topk``; the weights in the model dtype
    unless ``spec.weights_in_float``."""
    probs = torch.softmax(F.linear(x, router), dim=-1, dtype=torch.float32)
    weights, chosen = torch.topk(probs, spec.top_k, dim=-1)
    if spec.norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if not spec.weights_in_float:
        weights = weights.to(x.dtype)
    return weights, chosen


def experts_reference(
    x: Tensor, gate_up: Tensor, down: Tensor, weights: Tensor, chosen: Tensor, act: Act
) -> Tensor:
    """The chosen experts' weighted sum, expert by expert (host syncs: never captured).

    Args:
        gate_up: ``[experts, 2 * width, hidden]``; down: ``[experts, hidden, width]``.
    """
    out = torch.zeros_like(x)
    for expert in chosen.unique().tolist():
        rows, slot = torch.where(chosen == expert)
        y = F.linear(act(F.linear(x.index_select(0, rows), gate_up[expert])), down[expert])
        out.index_add_(0, rows, (y * weights[rows, slot, None]).to(x.dtype))
    return out


def experts_grouped(
    x: Tensor, gate_up: Tensor, down: Tensor, weights: Tensor, chosen: Tensor, act: Act
) -> Tensor:
    """The same with the ``T * k`` token-expert pairs sorted by expert and two grouped
    matmuls (``torch._grouped_mm``): fixed shapes, no host sync."""
    n, k = chosen.shape
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pair rows, grouped by expert
    counts = torch.zeros(gate_up.shape[0], dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    offsets = counts.cumsum(0).to(torch.int32)  # each expert's last row + 1
    h = torch._grouped_mm(x.index_select(0, order // k), gate_up.transpose(-2, -1), offs=offsets)
    y = torch._grouped_mm(act(h), down.transpose(-2, -1), offs=offsets)
    y = (y * weights.reshape(-1)[order, None]).to(x.dtype)
    pairs = torch.empty_like(y).index_copy_(0, order, y)  # back in (token, slot) order
    return pairs.view(n, k, -1).sum(dim=1)


def experts_dense(
    x: Tensor, gate_up: Tensor, down: Tensor, weights: Tensor, chosen: Tensor, act: Act
) -> Tensor:
    """The same with every expert on every token, scaled by its routing weight (zero
    where not chosen): static shapes, ``experts / k`` times the compute."""
    scale = torch.zeros(
        x.shape[0], gate_up.shape[0], dtype=weights.dtype, device=x.device
    ).scatter_(1, chosen, weights)
    out = torch.zeros_like(x)
    for expert in range(gate_up.shape[0]):
        y = F.linear(act(F.linear(x, gate_up[expert])), down[expert])
        out += (y * scale[:, expert, None]).to(x.dtype)
    return out


EXPERT_PATHS = {
    "reference": experts_reference,
    "grouped": experts_grouped,
    "dense": experts_dense,
}


def expert_path(device: torch.device, dtype: torch.dtype, spec: MoESpec, hidden: int) -> str:
    """The way the experts run on ``device``: ``reference`` on CPU; on CUDA ``grouped``
    where `grouped_mm_works`, else ``dense`` (both CUDA-graph safe)."""
    if device.type != "cuda":
        return "reference"
    aligned = all(size % 16 == 0 for size in (hidden, spec.intermediate))
    return "grouped" if aligned and grouped_mm_works(device, dtype) else "dense"


@functools.cache
def grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` exists and computes a small grouped matmul right on
    ``device`` in ``dtype`` (tried once, outside any graph capture)."""
    if not hasattr(torch, "_grouped_mm") or dtype != torch.bfloat16:
        return False
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(48, 32, generator=gen).to(device, dtype)
    w = torch.randn(3, 64, 32, generator=gen).to(device, dtype)
    offsets = torch.tensor([16, 16, 48], dtype=torch.int32, device=device)  # one empty
    try:
        got = torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)
    except (RuntimeError, NotImplementedError):
        return False
    want = torch.cat([x[:16] @ w[0].T, x[16:] @ w[2].T])
    return bool(torch.allclose(got.float(), want.float(), atol=0.1, rtol=0.05))
