"""The model families of the native rollout engine, one registered unit per file.

`base` holds the contract (`Family`: config reader, weight-name map, tensor-parallel plan,
rotary tables) and the registry, `FAMILIES`; every other module here is one family, which
registers itself under its transformers ``model_type`` when this package imports it
(all of them, below). `family_for(config)` finds a model's family; `spec_of(config)` and
`rotary_tables(config, ...)` ask it.
"""

from __future__ import annotations

import importlib
import pkgutil

import torch
from torch import Tensor

from rayrl.rollout.native.families.base import FAMILIES, Family, family_for
from rayrl.rollout.native.spec import ModelSpec

__all__ = ["FAMILIES", "Family", "family_for", "rotary_tables", "spec_of"]

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")


def spec_of(config) -> ModelSpec:
    """Read a transformers config through its family; raise `UnsupportedModelError` for
    a model no family runs, or a feature its family does not implement."""
    return family_for(config).read(config)


def rotary_tables(config, max_positions: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """float32 ``cos, sin`` tables ``[tables, max_positions, rotary dims]`` as transformers
    computes them, with the model family's own rotary-embedding module (one table for
    most families; a layer's is `ModelSpec.rope_table`)."""
    return family_for(config).rotary(config, max_positions, device)
