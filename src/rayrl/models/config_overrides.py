"""verl's `model.override_config`: values set on a Hugging Face model config after it loads.

Every role that builds a model from the directory (actor, reference, rollout engines,
critic, SFT) applies the same overrides, so they all see one config. A key names an
attribute of the config; a dict value sets attributes of the sub-config of that name
(`text_config: {rope_theta: ...}`), as verl's `update_model_config` does. verl's
Megatron spelling, the overrides under one `model_config` key, means the same.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def apply_config_overrides(config: Any, overrides: Mapping[str, Any] | None, where: str) -> Any:
    """Set `overrides` on the HF `config` (in place) and return it; `where` names the
    setting in an error (a dict value for an attribute that is not a sub-config)."""
    if not overrides:
        return config
    if set(overrides) == {"model_config"} and isinstance(overrides["model_config"], Mapping):
        overrides = overrides["model_config"]
    for key, value in overrides.items():
        if isinstance(value, Mapping):
            sub = getattr(config, key, None)
            if sub is None or isinstance(sub, (int, float, str, bool, list, tuple)):
                raise ValueError(
                    f"{where}.{key}: the model config ({type(config).__name__}) has no "
                    f"sub-config {key!r} to set {dict(value)} on; give plain values"
                )
            if isinstance(sub, dict):
                sub.update(value)
            else:
                apply_config_overrides(sub, value, f"{where}.{key}")
        else:
            setattr(config, key, value)
    return config
