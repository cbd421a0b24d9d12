"""Expert parallelism for transformers' mixture-of-experts blocks (Qwen2-MoE, Qwen3-MoE,
Mixtral).

In transformers 5 a block's experts are one module holding each weight of all ``E``
experts as a 3-D parameter (``gate_up_proj`` ``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``);
the block asks its router (``block.gate``, where routing replay hooks sit:
`rayrl.train.router_replay`) for each token's ``top_k`` experts and weights and calls
``experts(hidden, top_k_index, top_k_weights)``. With ``ep`` expert-parallel ranks,
`shard_experts` keeps the router as it is and changes only the experts module:

* **weights**: each 3-D parameter becomes a DTensor sharded on dim 0 over the ``ep``
  mesh, so a rank holds experts ``[r E/ep, (r+1) E/ep)``; FSDP2 then shards those
  local experts over the ranks that hold the same ones (the ``edp`` mesh, every
  ``ep``-th rank), not over ranks holding other experts. So a rank keeps ``1/world``
  of the expert weights as of every other weight, and the gradient of an expert shard
  is reduced over exactly the ranks that hold it. Each rank's loss is scaled by the
  world size before ``backward`` (`rayrl.train.loss_contract`) and an expert's
  gradient already sums the tokens its EP group sent it, so that reduction must divide
  by the world size, not by the ``edp`` group's size: the forward scales the local
  experts' gradients by ``1/ep`` (`ScaleGrad`) before FSDP averages them over ``edp``
  (FSDP2's own divide factor would do it with NCCL's PreMulSum, which gloo lacks).
* **forward**: the routing stays local (each rank routes its own tokens); the tokens'
  copies, sorted by expert, go to the ranks that hold their experts with an
  all-to-all (the counts per expert first, then the rows:
  `rayrl.train.all_to_all`), each rank runs its experts on what it received, the
  results come back the reverse way and are combined with the routing weights, as
  transformers' own experts do (``out[t] += w[t, j] x expert_j(x[t])``).

Every rank of an EP group runs the same exchanges per block, so every rank runs every
micro-batch (the engine's dummy micro-batches keep that true).
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rayrl.train.all_to_all import all_to_all

__all__ = ["EXPERT_WEIGHTS", "expert_modules", "expert_parallel", "num_experts", "shard_experts"]

# The 3-D weights of a transformers 5 experts module, experts on dim 0.
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The model's experts modules: those holding every weight of `EXPERT_WEIGHTS` as a
    3-D tensor, in layer order."""
    found = []
    for module in model.modules():
        weights = [getattr(module, n, None) for n in EXPERT_WEIGHTS]
        if all(isinstance(w, Tensor) and w.dim() == 3 for w in weights):
            found.append(module)
    return found


def num_experts(config: Any) -> int | None:
    """The experts per block a model config names (Qwen's ``num_experts``, Mixtral's
    ``num_local_experts``), None for a dense model."""
    for key in ("num_experts", "num_local_experts"):
        value = getattr(config, key, None)
        if value:
            return int(value)
    return None


def shard_experts(
    model: nn.Module, ep_mesh: Any, edp_mesh: Any, policy: Any, reshard_after_forward: bool
) -> None:
    """Split every experts module of ``model`` over ``ep_mesh`` and FSDP-shard its local
    experts over ``edp_mesh`` (module docstring); before the layers are wrapped."""
    from torch.distributed.fsdp import fully_shard

    experts = expert_modules(model)
    if not experts:
        raise ValueError(
            f"expert parallelism: {type(model).__name__} has no experts module with 3-D "
            "gate_up_proj / down_proj weights (transformers 5's MoE layout); set "
            "actor_rollout_ref.actor.expert_parallel_size=1"
        )
    for module in experts:
        expert_parallel(module, ep_mesh)
        fully_shard(
            module,
            mesh=edp_mesh,
            mp_policy=policy,
            reshard_after_forward=reshard_after_forward,
        )
    model._rayrl_expert_parallel = ep_mesh.size()


def expert_parallel(module: nn.Module, ep_mesh: Any) -> None:
    """One experts module split over ``ep_mesh``: this rank's experts as a DTensor slice
    of each weight, and the all-to-all forward (module docstring). Its weights'
    gradients come out ``1/ep`` of their sum, for FSDP's reduction over ``edp``."""
    _distribute(module, ep_mesh)
    module._rayrl_ep_group = ep_mesh.get_group()
    module.forward = types.MethodType(_expert_parallel_forward, module)


def _distribute(module: nn.Module, ep_mesh: Any) -> None:
    """Each 3-D weight as a DTensor sharded on dim 0 over ``ep_mesh``: this rank's slice
    of the experts (a meta weight stays on the meta device)."""
    from torch.distributed.tensor import DTensor, Shard

    size, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    for name in EXPERT_WEIGHTS:
        full = getattr(module, name)
        local = full.detach().chunk(size, dim=0)[rank].clone()
        sharded = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
        setattr(module, name, nn.Parameter(sharded, requires_grad=full.requires_grad))


class ScaleGrad(torch.autograd.Function):
    """The identity forward; the gradient times ``scale`` backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.scale, None


def _local(weight: Tensor, ranks: int) -> Tensor:
    """This rank's experts of ``weight``, their gradient scaled by ``1/ranks`` (module
    docstring)."""
    local = weight.to_local() if hasattr(weight, "to_local") else weight
    return ScaleGrad.apply(local, 1.0 / ranks)


def _expert_parallel_forward(
    self: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor
) -> Tensor:
    """transformers' experts forward, with each expert run on the rank that holds it."""
    group = self._rayrl_ep_group
    ranks = torch.distributed.get_world_size(group)
    gate_up, down = _local(self.gate_up_proj, ranks), _local(self.down_proj, ranks)
    local = gate_up.shape[0]
    k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) copies sorted by expert
    token_of = order // k
    per_expert = torch.bincount(flat, minlength=self.num_experts)
    received = torch.empty_like(per_expert)  # [source rank, my local expert]
    torch.distributed.all_to_all_single(received, per_expert, group=group)
    send = per_expert.view(ranks, local).sum(dim=1).tolist()
    counts = received.view(ranks, local)
    recv = counts.sum(dim=1).tolist()
    rows = all_to_all(hidden_states[token_of], recv, send, group)
    out_rows = _run_local_experts(self, rows, counts, gate_up, down)
    back = all_to_all(out_rows, send, recv, group)
    weights = top_k_weights.reshape(-1)[order]
    combined = torch.zeros_like(hidden_states)
    return combined.index_add(0, token_of, (back * weights[:, None]).to(combined.dtype))


def _run_local_experts(
    module: nn.Module, rows: Tensor, counts: Tensor, gate_up: Tensor, down: Tensor
) -> Tensor:
    """Each received row through its expert; ``counts[s, e]``: rows from rank ``s`` for
    local expert ``e`` (each source's rows come sorted by expert)."""
    ranks, local = counts.shape
    expert_of = torch.arange(local, device=rows.device).repeat(ranks)
    expert_of = torch.repeat_interleave(expert_of, counts.reshape(-1))
    order = torch.argsort(expert_of, stable=True)
    parts = []
    for e, chunk in enumerate(rows[order].split(counts.sum(dim=0).tolist())):
        gate, up = F.linear(chunk, gate_up[e]).chunk(2, dim=-1)
        parts.append(F.linear(module.act_fn(gate) * up, down[e]))
    return torch.cat(parts)[torch.argsort(order)]
