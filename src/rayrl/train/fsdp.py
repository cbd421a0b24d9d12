"""FSDP2 wrapping, mixed precision and CPU offload for the training engine.

`shard_model` applies ``torch.distributed.fsdp.fully_shard`` to every decoder layer (a
vision-language model's vision blocks too, then its vision tower as a whole, so that a
frozen tower's parameters are never in a unit with trained ones) and then to the root
module, over the engine's mesh (`rayrl.train.mesh`: 1-D over all ranks, or 2-D for
hybrid sharding) or a 1-D mesh of all ranks (one rank too: then it is how a single GPU
computes in bf16 from fp32 master weights, each weight cast once per forward or
backward of its layer instead of at every use as autocast does;
`ensure_process_group` gives such a process the one-rank group a mesh needs). On GPU the
parameters are cast to bf16 for compute while the sharded fp32 parameters stay the
master copy the optimizer updates, and gradients are reduced in fp32; on CPU
everything stays fp32. `offload_*` / `onload_*` move parameters, gradients and
optimizer state between the device and host memory between phases.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rayrl.models.vision_language import vision_tower
from rayrl.train.expert_parallel import shard_experts

__all__ = [
    "attention_modules",
    "decoder_layers",
    "dp_world_size",
    "ensure_process_group",
    "offload_model",
    "offload_optimizer",
    "onload_model",
    "onload_optimizer",
    "shard_model",
]


def dp_world_size() -> int:
    """Ranks in the default process group, or 1 when torch.distributed is not set up."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def ensure_process_group(device_type: str) -> None:
    """A one-rank default process group when this process has none (an engine on one
    device; a group of several ranks is formed by the worker group before)."""
    if dist.is_initialized():
        return
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: modules whose class is in ``_no_split_modules``.

    Hugging Face models name their decoder-layer class there (``Qwen2DecoderLayer``).
    Falls back to the children of the longest ``nn.ModuleList``.
    """
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if layers:
        return layers
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise ValueError(
            f"cannot find decoder layers in {type(model).__name__}: it has no "
            "_no_split_modules and no nn.ModuleList; FSDP needs per-layer units."
        )
    longest = max(lists, key=len)
    return list(longest)


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """Each decoder layer's attention module (its ``self_attn``)."""
    return [layer.self_attn for layer in decoder_layers(model) if hasattr(layer, "self_attn")]


def shard_model(
    model: nn.Module,
    device_type: str,
    mixed_precision: bool,
    reshard_after_forward: bool = True,
    mesh: Any = None,
    experts: tuple[Any, Any] | None = None,
) -> nn.Module:
    """Apply FSDP2 to each decoder layer and the root; returns the model.

    ``mesh``: a 1-D device mesh (shard over its ranks) or a 2-D ``[replicate, shard]``
    one (HSDP: `rayrl.train.mesh`); default, 1-D over all ranks. With
    ``mixed_precision`` (GPU), compute runs in bf16 with fp32 master weights and fp32
    gradient reduction. FSDP moves each rank's shard to the mesh's device (a model on
    the meta device stays there, sharded, until ``to_empty``).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    ensure_process_group(device_type)
    if mesh is None:
        mesh = init_device_mesh(device_type, (dp_world_size(),))
    if mixed_precision:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        policy = MixedPrecisionPolicy()
    if experts is not None:
        shard_experts(model, *experts, policy, reshard_after_forward)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    tower = vision_tower(model)  # its patch embedding and merger: a unit of their own
    if tower is not None:
        fully_shard(tower, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    return model


def _empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def offload_model(model: nn.Module, frozen: bool = False) -> None:
    """Move parameters and gradients to host memory (works on FSDP2-sharded models).

    From a GPU, plain (unsharded) parameters go into page-locked host buffers kept on
    the module (allocated once, at their exact size), so both directions run at full
    PCIe speed; a ``frozen`` model's weights (a reference policy) are copied there once
    and later offloads only drop the device copy. FSDP2's DTensors, buffers and
    gradients move with ``Module.to``. Parameter objects stay the same, so the
    optimizer's references stay valid.
    """
    device = next(model.parameters()).device
    if device.type == "cuda":
        _park_plain_parameters(model, frozen)
        torch.cuda.synchronize(device)  # the host copies are complete before anyone reads
    model.to("cpu")
    _empty_cache(device)


def _park_plain_parameters(model: nn.Module, frozen: bool) -> None:
    host = model.__dict__.setdefault("_rayrl_host_params", {})
    for param in model.parameters():
        if hasattr(param, "to_local") or param.device.type != "cuda":
            continue  # FSDP2's DTensors: Module.to
        buffer = host.get(id(param))
        fresh = buffer is None or buffer.shape != param.shape or buffer.dtype != param.dtype
        if fresh:
            buffer = host[id(param)] = pinned_host_buffer(param.data)
        if fresh or not frozen:
            buffer.copy_(param.data, non_blocking=True)
        if param.grad is not None:
            param.grad = param.grad.to("cpu")
        param.data = buffer


def onload_model(model: nn.Module, device: torch.device) -> None:
    """Move parameters and gradients back to ``device`` (from page-locked buffers where
    `offload_model` parked them: asynchronous copies)."""
    if torch.device(device).type == "cuda":
        host = model.__dict__.get("_rayrl_host_params", {})
        for param in model.parameters():
            buffer = host.get(id(param))
            if buffer is not None and param.data_ptr() == buffer.data_ptr():
                param.data = param.data.to(device, non_blocking=True)
    model.to(device)


def _move_optimizer_state(
    optimizer: torch.optim.Optimizer,
    device: torch.device | str,
    params: list[nn.Parameter] | None = None,
) -> None:
    """Move the state tensors (not the step counts) of ``params`` (default: all) to ``device``.

    Moving from a GPU to the host copies (an FSDP2 shard's state: its local part) into
    pinned buffers kept on the optimizer (allocated once, reused every offload), so both
    directions run at full PCIe speed.
    """
    device = torch.device(device)
    host = optimizer.__dict__.setdefault("_rayrl_host_state", {})
    states = (
        optimizer.state.items()
        if params is None
        else [(p, optimizer.state[p]) for p in params if p in optimizer.state]
    )
    for param, state in states:
        for key, value in state.items():
            if not isinstance(value, torch.Tensor) or key == "step" or value.device == device:
                continue
            if device.type == "cpu" and value.device.type == "cuda":
                local = value.to_local() if hasattr(value, "to_local") else value
                slot = (id(param), key)
                buffer = host.get(slot)
                if buffer is None or buffer.shape != local.shape or buffer.dtype != local.dtype:
                    buffer = host[slot] = pinned_host_buffer(local)
                state[key] = _like(value, buffer.copy_(local, non_blocking=True))
            else:
                state[key] = value.to(device, non_blocking=True)
    if device.type == "cpu" and torch.cuda.is_available():
        torch.cuda.synchronize()


def _like(value: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as ``value`` is: the same DTensor layout (an FSDP2 shard's state) or plain."""
    if not hasattr(value, "to_local"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local,
        value.device_mesh,
        value.placements,
        run_check=False,
        shape=value.shape,
        stride=value.stride(),
    )


def pinned_host_buffer(like: torch.Tensor) -> torch.Tensor:
    """A host tensor shaped like ``like``, page-locked at its exact size where CUDA is
    available (pageable where that fails).

    Not ``pin_memory=True``: torch's caching host allocator rounds every pinned block up
    to a power of two: by our count the Adam moments of a Qwen2.5-7B-shaped model, 61 GB,
    take 116 GB pinned per parameter (an MLP weight's 272 MB moment is a 512 MB block),
    more than the host of a one-GPU 7B run holds (docs/benchmarks.md). The buffer is
    registered with ``cudaHostRegister`` instead (exact size), and unregistered when
    it is freed.
    """
    buffer = torch.empty(like.shape, dtype=like.dtype, device="cpu")
    if buffer.numel() and torch.cuda.is_available():
        _register_pinned(buffer)
    return buffer


def _register_pinned(buffer: torch.Tensor) -> None:
    """Page-lock ``buffer``'s memory in place (exact size); left pageable if CUDA refuses."""
    import weakref

    cudart = torch.cuda.cudart()
    ptr, size = buffer.data_ptr(), buffer.numel() * buffer.element_size()
    if int(cudart.cudaHostRegister(ptr, size, 0)) == 0:
        weakref.finalize(buffer, cudart.cudaHostUnregister, ptr)


def offload_optimizer(
    optimizer: torch.optim.Optimizer, params: list[nn.Parameter] | None = None
) -> None:
    """Move the optimizer's state tensors (Adam moments) of ``params`` (default: all) to
    host memory."""
    devices = {v.device for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)}
    _move_optimizer_state(optimizer, "cpu", params)
    if params is None:
        for device in devices:
            _empty_cache(device)


def onload_optimizer(
    optimizer: torch.optim.Optimizer, device: torch.device, params: list[nn.Parameter] | None = None
) -> None:
    """Move the optimizer's state tensors of ``params`` (default: all) back to ``device``."""
    _move_optimizer_state(optimizer, device, params)
