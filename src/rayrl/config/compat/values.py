"""verl values that rayrl spells otherwise: the rollout engine names, and booleans given
as save or validation frequencies."""

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


FREQUENCY_KEYS = ("save_freq", "test_freq")


def map_bool_frequencies(data: dict[str, Any]) -> None:
    """`trainer.save_freq` / `test_freq` given as a boolean (verl's scripts pass
    `test_freq=$VAL_BEFORE_TRAIN`), as verl reads it: `freq > 0 and step % freq == 0`
    makes false never (-1) and true every step (1)."""
    trainer = data.get("trainer")
    if not isinstance(trainer, dict):
        return
    for key in FREQUENCY_KEYS:
        if isinstance(trainer.get(key), bool):
            trainer[key] = 1 if trainer[key] else -1
