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

``capture(..., reuse=True)`` copies into host buffers kept per model from one capture
to the next (page-locked at exact size on CUDA: one asynchronous copy per tensor and a
single wait, instead of a blocking copy into freshly faulted pages): the arrays it
returns change at the next reusing capture, so their consumer (the worker's snapshot
return, copied into Ray's object store) must be done with them by then.

``capture(..., reuse=True, stream=s)`` does not wait at all: the copies are queued on the
CUDA stream ``s`` behind the work already queued, and the caller records an event on
``s`` to know when the arrays are complete. Until then the device's tensors must not
change (the engine holds its optimizer step and any restore behind that event,
`rayrl.train.recovery`); their memory is not reused meanwhile (each source is
recorded on ``s``), so a tensor freed before the copies end is still copied whole.
"""

from __future__ import annotations

from typing import Any
from weakref import WeakKeyDictionary

import numpy as np
import torch
from torch import nn

from rayrl.train.fsdp import pinned_host_buffer

__all__ = ["capture", "nbytes", "restore"]

# dtypes NumPy has no type for, kept as raw bits of the same width
_RAW = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.int8}
# capture(reuse=True)'s host buffers, by model and tensor key
_BUFFERS: WeakKeyDictionary[nn.Module, dict[str, torch.Tensor]] = WeakKeyDictionary()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def nbytes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes a `capture` of this rank holds: the trainable tensors' local parts and the
    optimizer's state (before its first step: two moments per trainable element, as
    AdamW will make)."""
    weights: int = sum(
        _local(p).numel() * p.element_size() for p in model.parameters() if p.requires_grad
    )
    if optimizer is None:
        return weights
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    if not state:
        return 3 * weights
    total: int = weights + sum(_local(v).numel() * v.element_size() for v in state)
    return total


def _to_host(
    t: torch.Tensor,
    buffers: dict[str, torch.Tensor] | None = None,
    key: str = "",
    stream: torch.cuda.Stream | None = None,
) -> tuple[np.ndarray, str, str]:
    """(array, dtype name, device) of a tensor's local part, copied to host memory (into
    ``buffers[key]`` when ``buffers`` is given: asynchronously from a GPU, so the
    caller synchronises before the arrays are read; on ``stream`` when given)."""
    local = _local(t).detach()
    device = str(local.device)
    raw = _RAW.get(local.dtype)
    if buffers is None:
        host = local.to("cpu", copy=True)  # the live tensor keeps changing after this
    else:
        host = buffers.get(key)
        if host is None or host.shape != local.shape or host.dtype != local.dtype:
            host = buffers[key] = pinned_host_buffer(local)
        if stream is not None and local.is_cuda:
            local.record_stream(stream)  # its memory stays until the copy is done
        host.copy_(local, non_blocking=True)
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
    reuse: bool = False,
    stream: torch.cuda.Stream | None = None,
) -> dict[str, Any]:
    """This rank's part of the engine state (see the module docstring; ``reuse``: into
    the model's kept host buffers; ``stream``, with ``reuse``: the copies queued there,
    not waited for)."""
    if stream is not None and not reuse:
        raise ValueError("capture(stream=...) copies into the kept buffers: pass reuse=True")
    if stream is None:
        return _capture(model, optimizer, scheduler, counters, reuse, None)
    stream.wait_stream(torch.cuda.current_stream(stream.device))  # behind the queued work
    with torch.cuda.stream(stream):
        return _capture(model, optimizer, scheduler, counters, reuse, stream)


def _capture(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    counters: dict[str, int],
    reuse: bool,
    stream: torch.cuda.Stream | None,
) -> dict[str, Any]:
    names = {id(p): n for n, p in model.named_parameters()}
    kept = _BUFFERS.setdefault(model, {}) if reuse else None

    def host(kind: str, name: str, t: torch.Tensor) -> tuple[np.ndarray, str, str]:
        return _to_host(t, kept, f"{kind}:{name}", stream)

    state: dict[str, Any] = {
        "params": {n: host("p", n, p) for n, p in model.named_parameters() if p.requires_grad},
        "buffers": {n: host("b", n, b) for n, b in _persistent_buffers(model)},
        "counters": dict(counters),
        "optim": {},
        "groups": [],
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
    }
    if optimizer is not None:
        for param, values in optimizer.state.items():
            name = names[id(param)]
            state["optim"][name] = {
                k: host(f"o:{k}", name, v) if torch.is_tensor(v) else v for k, v in values.items()
            }
        state["groups"] = [
            {k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups
        ]
    if kept is not None and stream is None and torch.cuda.is_available():
        torch.cuda.synchronize()  # the asynchronous copies into the kept buffers
    return state


def restore(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    state: dict[str, Any],
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


def _optim_tensor(param: torch.Tensor, value: tuple[np.ndarray, str, str]) -> torch.Tensor:
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
