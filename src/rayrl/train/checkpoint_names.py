"""A checkpoint's tensor names as the model names them.

transformers saves some models under other names than their modules have: a Qwen2.5-VL
checkpoint holds ``model.layers.*`` and ``visual.*`` where the model built from its config
has ``model.language_model.layers.*`` and ``model.visual.*``, and ``from_pretrained``
renames them as it loads (its conversion mapping for the model's classes). The training
engine reads a checkpoint itself (`rayrl.train.load_once`), so it renames the same way:
`as_model_names` re-keys a `CheckpointIndex` by the model's names, applying only
transformers' pure renamings (a conversion that changes tensors, such as fusing
experts, is not applied: the names then stay unmatched and the engine loads with
``from_pretrained``, saying so).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from rayrl.models.safetensors_read import CheckpointIndex

if TYPE_CHECKING:
    from transformers.core_model_loading import WeightRenaming

__all__ = ["as_model_names"]


def as_model_names(index: CheckpointIndex, model: nn.Module, wanted: set[str]) -> CheckpointIndex:
    """``index`` keyed by ``model``'s names: as it is when it holds every name in
    ``wanted`` (the model's checkpoint tensors), else with transformers' renamings for
    ``model`` applied to each saved name (a name no renaming changes stays as it is)."""
    if wanted <= set(index):
        return index
    renamings = _renamings(model)
    if not renamings:
        return index
    renamed = CheckpointIndex()
    for name, entry in index.items():
        for renaming in renamings:
            name, _ = renaming.rename_source_key(name)
        renamed[name] = entry
    return renamed


def _renamings(model: nn.Module) -> list[WeightRenaming]:
    """transformers' pure renamings of saved names for ``model`` (none if it has no
    conversion mapping, or this transformers has no such API)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:  # pragma: no cover - an older transformers: names as saved
        return []
    try:
        transforms = get_model_conversion_mapping(model)
    except Exception:  # noqa: BLE001 - a model transformers cannot map: names as saved
        return []
    return [t for t in transforms if type(t) is WeightRenaming]
