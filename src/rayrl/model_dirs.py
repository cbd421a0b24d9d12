"""What a local model directory's config.json says, read without transformers: the one
place both the config checks (before anything starts) and the model code ask whether a
model is vision-language (it has a vision tower: `vision_config`, as Qwen2-VL,
Qwen2.5-VL and Qwen3-VL have).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["VISION_CONFIG_KEYS", "is_vision_language", "local_config"]

VISION_CONFIG_KEYS = ("vision_config", "visual", "vision_tower")


def is_vision_language(config: Any) -> bool:
    """Whether ``config`` (a transformers config, or a config.json's dict) has a vision tower."""
    if isinstance(config, Mapping):
        return any(key in config for key in VISION_CONFIG_KEYS)
    return any(getattr(config, key, None) is not None for key in VISION_CONFIG_KEYS)


def local_config(path: str | Path | None) -> dict[str, Any] | None:
    """The config.json of a local model directory, or None (no such file, or unreadable)."""
    if not path:
        return None
    file = Path(path).expanduser() / "config.json"
    try:
        found = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None
