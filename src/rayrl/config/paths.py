"""A config's paths are the driver's: relative ones are resolved once, at load, against
the directory rayrl runs in.

Ray's workers keep the directory their Ray started in: the driver's for a Ray the run
starts, wherever `ray start` ran for a cluster joined through `resources.address`. A
relative `trainer.output_dir` or model path would then name another place in every
worker (a model "not found", checkpoint shards written beside another directory), so
the loaders make them absolute before anything reads them:

- a field named `*_dir` (the run directory and the other output directories): always;
- a field named `*path`, `train_files`, `val_files` or SFT's `partial_pretrain` (inputs,
  a path or a list of them), or a `*path` entry of a mapping field (a distillation
  teacher's `model_path`): where the relative
  path exists here, so that a hub name (`Qwen/Qwen2.5-0.5B`) or a URL stays as written.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

INPUTS = ("train_files", "val_files", "partial_pretrain")  # inputs not named *path


def absolute_paths(cfg: DataclassInstance) -> None:
    """Make the relative paths of the config dataclass `cfg` (and its groups) absolute
    in place (module docstring)."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            absolute_paths(cast("DataclassInstance", value))
        elif f.name.endswith("_dir") and isinstance(value, str) and value:
            setattr(cfg, f.name, _absolute(value, always=True))
        elif isinstance(value, dict):
            _absolute_in(value)
        elif f.name.endswith("path") or f.name in INPUTS:
            if isinstance(value, list):
                setattr(cfg, f.name, [_absolute(v, always=False) for v in value])
            elif isinstance(value, str) and value:
                setattr(cfg, f.name, _absolute(value, always=False))


def _absolute_in(mapping: dict[Any, Any]) -> None:
    """The `*path` entries of a free-form mapping (distillation's teacher entries, by
    name) and of the mappings in it, made absolute as fields of those names are."""
    for key, value in mapping.items():
        if isinstance(value, dict):
            _absolute_in(value)
        elif isinstance(key, str) and key.endswith("path") and isinstance(value, str) and value:
            mapping[key] = _absolute(value, always=False)


def _absolute(value: Any, always: bool) -> Any:
    """`value` made absolute when it is a local relative path (always, or where it
    exists, `~` expanded); URLs, `pkg://` modules and anything else as they are."""
    if not isinstance(value, str) or "://" in value:
        return value
    path = Path(value).expanduser()
    if not (always or path.exists()):
        return value
    return str(path.absolute())
