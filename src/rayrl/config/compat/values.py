"""verl values that rayrl spells otherwise: the rollout engine names."""

from __future__ import annotations

from typing import Any

ROLLOUT_KEY = "actor_rollout_ref.rollout.name"
ROLLOUT_ALIASES: dict[str, str] = {"vllm": "auto", "sglang": "auto", "trtllm": "auto"}


def map_rollout_name(data: dict[str, Any]) -> list[str]:
    """Replace verl's rollout engine names (vllm, sglang) with rayrl's, with a warning."""
    rollout = data.get("actor_rollout_ref", {}).get("rollout", {})
    name = rollout.get("name") if isinstance(rollout, dict) else None
    if not isinstance(name, str) or name not in ROLLOUT_ALIASES:
        return []
    rollout["name"] = ROLLOUT_ALIASES[name]
    return [
        f"{ROLLOUT_KEY}={name}: rayrl has no {name} engine; it picks its own "
        "('auto': 'native' on a GPU for Qwen2/Qwen3/Llama models, else 'hf')"
    ]
