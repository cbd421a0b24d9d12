"""What a training engine keeps across a rebuild on a re-formed process group: its own
shards, so that a rank which survived the loss of another reads nothing from storage.

When a worker group replaces a lost rank, its process group re-forms and every
surviving rank rebuilds what was bound to the old one: the device mesh, the FSDP2
wrapping, the optimizer over the new parameters (`TrainEngine.rebuild`). The weights
themselves need not move: with the same world size and mesh layout, each parameter and
each optimizer moment is split exactly as before, so every rank's new shard is the one
it already holds. `keep` takes them before the old model goes:

* the local shard of every parameter and persistent buffer (frozen ones too: a
  reference policy's weights are in no snapshot); on a GPU they wait in host memory
  while the new model is allocated, so the device never holds two copies;
* the optimizer's state by parameter name (left where it is: it is moved into the
  new optimizer one tensor at a time), its hyperparameters, the LR scheduler's state
  and the engine's counters.

`Kept.layout_change(model)` says why the new (sharded, still empty) model is laid out
otherwise, if it is; the engine then reloads on every rank instead. `Kept.fill_model`
and `Kept.fill_optimizer` put the shards into the new model and optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from rayrl.train.load_once import checkpoint_tensors

# What decides which part of a tensor a rank holds (`_layout`): global shape, local
# shape, dtype, and for a DTensor its placements and the ranks of its mesh.
Layout = tuple[
    tuple[int, ...], tuple[int, ...], torch.dtype, tuple[str, ...] | None, tuple[int, ...] | None
]

__all__ = ["Kept", "keep"]


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _layout(t: Tensor) -> Layout:
    """What decides which part of a tensor a rank holds: global shape, local shape, dtype,
    and for a DTensor its placements and the ranks of its mesh."""
    if not hasattr(t, "to_local"):
        return (tuple(t.shape), tuple(t.shape), t.dtype, None, None)
    return (
        tuple(t.shape),
        tuple(t.to_local().shape),
        t.dtype,
        tuple(str(p) for p in t.placements),
        tuple(t.device_mesh.mesh.flatten().tolist()),
    )


def _sharded_state(model: nn.Module) -> None:
    """Every FSDP2 module back to its sharded parameters (a call that failed inside a
    forward can leave a layer's gathered ones registered); local, no collective."""
    for module in model.modules():
        reshard = getattr(module, "reshard", None)
        if reshard is not None and hasattr(module, "unshard"):
            reshard()


@dataclass
class Kept:
    """One rank's shards of an engine's model and optimizer, taken by `keep`."""

    tensors: dict[str, Tensor]
    layouts: dict[str, Layout]
    optim: dict[str, dict[str, Any]] = field(default_factory=dict)
    optim_layouts: dict[str, dict[str, Layout]] = field(default_factory=dict)
    groups: list[dict[str, Any]] = field(default_factory=list)
    scheduler: dict[str, Any] | None = None
    counters: dict[str, int] = field(default_factory=dict)

    def layout_change(self, model: nn.Module) -> str:
        """Why ``model`` (built and sharded on the new process group, its parameters
        still on the meta device) does not hold the kept shards one for one; "" when it
        does."""
        tensors = dict(checkpoint_tensors(model))
        if set(tensors) != set(self.tensors):
            missing = sorted(set(self.tensors) ^ set(tensors))[:3]
            return f"the rebuilt model's tensors differ from the kept ones (e.g. {missing})"
        for name, tensor in tensors.items():
            if _layout(tensor) != self.layouts[name]:
                return f"{name} is laid out as {_layout(tensor)} now and was {self.layouts[name]}"
        for name, state in self.optim_layouts.items():
            param = tensors[name]
            for key, layout in state.items():
                if layout[0] == tuple(param.shape) and layout[1] != _layout(param)[1]:
                    return f"the optimizer's {key} of {name} no longer matches its shard"
        return ""

    def fill_model(self, model: nn.Module) -> None:
        """Copy the kept shards into ``model``'s allocated ones, freeing each as it goes."""
        with torch.no_grad():
            for name, target in checkpoint_tensors(model):
                _local(target).copy_(self.tensors.pop(name))

    def fill_optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        """The kept optimizer state on ``model``'s new parameters (each moment shaped and
        sharded like its parameter, on the device it was kept on)."""
        if optimizer is None:
            return
        params = dict(model.named_parameters())
        optimizer.state.clear()
        for name, values in self.optim.items():
            param = params[name]
            optimizer.state[param] = {
                k: _moved_state(param, v) if torch.is_tensor(v) else v for k, v in values.items()
            }
            values.clear()
        for group, saved in zip(optimizer.param_groups, self.groups, strict=True):
            group.update(saved)


def _moved_state(param: Tensor, value: Tensor) -> Tensor:
    """An optimizer state tensor on the new ``param``: a moment becomes a tensor laid out
    as the parameter (a DTensor on its new mesh) holding the kept local values, on the
    device it was kept on; a step count stays as it is."""
    local = _local(value)
    if local.dim() == 0 or tuple(local.shape) != tuple(_local(param).shape):
        return local
    out = torch.zeros_like(param, dtype=local.dtype)
    _local(out).copy_(local)
    return out if _local(out).device == local.device else out.to(local.device)


def keep(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    counters: dict[str, int],
) -> Kept:
    """This rank's shards of ``model`` and ``optimizer`` (module docstring)."""
    _sharded_state(model)
    tensors, layouts = {}, {}
    for name, tensor in checkpoint_tensors(model):
        local = _local(tensor).detach()
        layouts[name] = _layout(tensor.detach())
        tensors[name] = local.to("cpu") if local.device.type == "cuda" else local
    kept = Kept(tensors, layouts, counters=dict(counters))
    if optimizer is None:
        return kept
    names = {id(p): n for n, p in model.named_parameters()}
    for param, values in optimizer.state.items():
        name = names[id(param)]
        kept.optim[name] = {
            k: _local(v).detach() if torch.is_tensor(v) else v for k, v in values.items()
        }
        kept.optim_layouts[name] = {
            k: _layout(v.detach()) for k, v in values.items() if torch.is_tensor(v)
        }
    kept.groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    kept.scheduler = scheduler.state_dict() if scheduler is not None else None
    return kept
