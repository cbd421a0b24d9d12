"""Letting go of the process groups an engine's FSDP2 model and device meshes hold.

When a peer is lost inside a gloo collective, the ranks that saw the loss must free
their gloo contexts so that their sockets close and the ranks still waiting on them
fail too (`rayrl.controller.collective_failure`). Destroying the process groups in
c10d is not enough while other objects still refer to them:

* each FSDP2 parameter group's mesh info keeps the sharding (and, for HSDP, the
  replication) process group, and a pending all-gather keeps its work object;
* a device mesh keeps the groups of its dimensions in its root mesh's registry;
* the engine's sequence-parallel group (`rayrl.train.ulysses.SPGroup`).

`release_groups` drops those references in place. The model keeps its parameters
(its local shards, the optimizer state on them) but can no longer run a collective:
it serves only the engine's `rebuild`, which takes the shards and builds mesh and
FSDP wrapping again on the re-formed group. Nothing here waits or talks to a peer.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch.distributed as dist
from torch import nn

__all__ = ["release_groups"]


def _holds_group(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is a process group or a work object, or a (named) tuple holding
    one (an FSDP all-gather result or state)."""
    if isinstance(value, (dist.ProcessGroup, dist.Work)):
        return True
    return depth < 3 and isinstance(value, tuple) and any(_holds_group(v, depth + 1) for v in value)


def _fsdp_objects(model: nn.Module) -> Iterator[Any]:
    """The FSDP2 state objects of ``model`` that can refer to a process group."""
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        if get_state is None:
            continue
        state = get_state()
        yield state
        yield getattr(state, "_comm_ctx", None)
        group = getattr(state, "_fsdp_param_group", None)
        if group is None:
            continue
        yield group
        yield from (group.mesh_info, group.post_forward_mesh_info)
        for param in group.fsdp_params:
            yield from (param, param.mesh_info, param.post_forward_mesh_info)


def _clear_mesh(mesh: Any) -> None:
    registry = getattr(mesh._get_root_mesh(), "_pg_registry", None)
    if registry is not None:
        registry.clear()


def release_groups(model: nn.Module | None, meshes: Iterable[Any] = ()) -> int:
    """Drop the references ``model``'s FSDP2 states and ``meshes`` (device meshes) hold
    to process groups and pending collective work (module docstring); returns how many
    attributes it cleared."""
    cleared = 0
    for mesh in meshes:
        if mesh is not None:
            _clear_mesh(mesh)
    if model is None:
        return cleared
    for obj in _fsdp_objects(model):
        if obj is None or not hasattr(obj, "__dict__"):
            continue
        mesh = getattr(obj, "mesh", None)
        if mesh is not None and hasattr(mesh, "_get_root_mesh"):
            _clear_mesh(mesh)
        for name, value in list(vars(obj).items()):
            if _holds_group(value):
                setattr(obj, name, None)
                cleared += 1
    return cleared
