"""In-memory snapshots of a training engine at a step boundary, and putting them back.

A snapshot holds what a step changes and a fresh engine does not bring back on its
own: the trainable parameters and persistent buffers, the optimizer's state (Adam
moments, step counts) and hyperparameters (the LR the schedule set), the LR
scheduler and the engine's counters. Frozen weights are left out: rebuilding the
engine loads them again from the model directory.

Sharded (FSDP2) tensors are kept as this rank's local shard, with no collective, so a
replaced rank of the same world size gets exactly its own shard back. Tensors become
NumPy arrays in host memory (bf16 as its raw 16 bits), which Ray stores without a
pickle copy when the snapshot is returned to the driver.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = ["capture", "nbytes", "restore"]

# dtypes NumPy has no type for, kept as raw bits of the same width
_RAW = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.int8}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def nbytes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes a `capture` of this rank holds: the trainable tensors' local parts and the
    optimizer's state (before its first step: two moments per trainable element, as
    AdamW will make)."""
    weights = sum(_local(p).numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    if optimizer is None:
        return weights
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    if not state:
        return 3 * weights
    return weights + sum(_local(v).numel() * v.element_size() for v in state)


def _to_host(t: torch.Tensor) -> tuple[np.ndarray, str, str]:
    """(array, dtype name, device) of a tensor's local part, copied to host memory."""
    local = _local(t).detach()
    device = str(local.device)
    raw = _RAW.get(local.dtype)
    host = local.to("cpu", copy=True)  # the live tensor keeps changing after this
    array = (host.view(raw) if raw is not None else host).numpy()
    return array, str(local.dtype).removeprefix("torch."), device


def _from_host(value: tuple[np.ndarray, str, str]) -> torch.Tensor:
    array, dtype_name, _ = value
    dtype = getattr(torch, dtype_name)
    tensor = torch.from_numpy(np.array(array, copy=True))
    return tensor.view(dtype) if dtype in _RAW else tensor


def capture(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    counters: dict[str, int],
) -> dict[str, Any]:
    """This rank's part of the engine state (see the module docstring)."""
    names = {id(p): n for n, p in model.named_parameters()}
    state: dict[str, Any] = {
        "params": {n: _to_host(p) for n, p in model.named_parameters() if p.requires_grad},
        "buffers": {n: _to_host(b) for n, b in _persistent_buffers(model)},
        "counters": dict(counters),
        "optim": {},
        "groups": [],
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
    }
    if optimizer is not None:
        for param, values in optimizer.state.items():
            state["optim"][names[id(param)]] = {
                k: _to_host(v) if torch.is_tensor(v) else v for k, v in values.items()
            }
        state["groups"] = [
            {k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups
        ]
    return state


def restore(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, scheduler: Any, state: dict
) -> dict[str, int]:
    """Put `capture`'s state back into an engine of the same shape; returns its counters."""
    params = dict(model.named_parameters())
    buffers = dict(_persistent_buffers(model))
    with torch.no_grad():
        for name, value in state["params"].items():
            _local(params[name]).copy_(_from_host(value))
        for name, value in state["buffers"].items():
            _local(buffers[name]).copy_(_from_host(value))
    if optimizer is not None:
        optimizer.state.clear()
        for name, values in state["optim"].items():
            param = params[name]
            optimizer.state[param] = {
                k: _optim_tensor(param, v) if isinstance(v, tuple) else v for k, v in values.items()
            }
        for group, saved in zip(optimizer.param_groups, state["groups"], strict=True):
            group.update(saved)
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    return dict(state["counters"])


def _optim_tensor(param: torch.Tensor, value: tuple) -> torch.Tensor:
    """An optimizer state tensor: shaped (and sharded) like `param` when it was, else a
    plain tensor (a step count) on the device it was captured on."""
    host = _from_host(value)
    if host.shape == _local(param).shape and host.dim() > 0:
        out = torch.zeros_like(param, dtype=host.dtype)
        _local(out).copy_(host)
        return out if str(_local(out).device) == value[2] else out.to(value[2])
    return host.to(value[2])


def _persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    skip = set()
    for prefix, module in model.named_modules():
        for name in getattr(module, "_non_persistent_buffers_set", ()):
            skip.add(f"{prefix}.{name}" if prefix else name)
    return [(n, b) for n, b in model.named_buffers() if n not in skip]
