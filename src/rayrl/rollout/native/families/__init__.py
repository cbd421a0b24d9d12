"""The model families of the native rollout engine, one registered unit per file.

`base` holds the contract (`Family`: config reader, weight-name map, tensor-parallel plan,
rotary tables) and the registry, `FAMILIES`; every other module here is one family, which
registers itself under its transformers ``model_type`` when this package imports it
(all of them, below). `family_for(config)` finds a model's family.
"""

import importlib
import pkgutil

from rayrl.rollout.native.families.base import FAMILIES, Family, family_for

__all__ = ["FAMILIES", "Family", "family_for"]

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
