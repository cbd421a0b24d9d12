"""verl keys that rayrl accepts without acting on them, and verl values it maps.

verl command lines carry keys for features rayrl does not have (vLLM tensor
parallelism, weight load formats, multi-turn rollout, Ulysses sequence
parallelism, ...). Rather than refusing the whole line, `strip_inert` removes those
keys and returns one warning each, saying that the key has no effect in rayrl and why.
A key listed here is not in the schema; a group listed here takes all its sub-keys.

verl's rollout names (`vllm`, `sglang`) name engines rayrl does not ship; they map to
rayrl's engine with a warning (`ROLLOUT_ALIASES`).
"""

from __future__ import annotations

from typing import Any

_NO_TP = "rayrl's rollout engines run one model copy per GPU (no tensor parallelism)"
_NO_SP = "rayrl has no Ulysses sequence parallelism"
_VLLM = "a vLLM/SGLang engine setting; rayrl's rollout engines do not use it"

INERT: dict[str, str] = {
    "actor_rollout_ref.rollout.tensor_model_parallel_size": _NO_TP,
    "actor_rollout_ref.rollout.data_parallel_size": _NO_TP,
    "actor_rollout_ref.rollout.expert_parallel_size": _NO_TP,
    "actor_rollout_ref.rollout.pipeline_model_parallel_size": _NO_TP,
    "actor_rollout_ref.rollout.load_format": "rollout weights come from the training engine",
    "actor_rollout_ref.rollout.layered_summon": "rollout weights come from the training engine",
    "actor_rollout_ref.rollout.multi_turn": "rayrl has no multi-turn or tool rollouts",
    "actor_rollout_ref.rollout.enable_chunked_prefill": _VLLM,
    "actor_rollout_ref.rollout.engine_kwargs": _VLLM,
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": _NO_SP,
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size": _NO_SP,
    "critic.ulysses_sequence_parallel_size": _NO_SP,
    "actor_rollout_ref.model.use_shm": "models load from their directory as they are",
    "actor_rollout_ref.model.use_fused_kernels": "rayrl computes log-probs in chunks its own way",
    "actor_rollout_ref.model.use_liger": "rayrl does not use Liger kernels",
    "actor_rollout_ref.model.lora_adapter_path": (
        "rayrl does not load saved adapters: LoRA starts from fresh adapters"
    ),
    "actor_rollout_ref.hybrid_engine": (
        "rayrl always runs actor, rollout and reference in one process"
    ),
    "data.return_raw_chat": "rayrl always keeps the raw chat messages (raw_prompt)",
    "trainer.use_legacy_worker_impl": "rayrl has one worker implementation",
}

ROLLOUT_KEY = "actor_rollout_ref.rollout.name"
ROLLOUT_ALIASES: dict[str, str] = {"vllm": "auto", "sglang": "auto"}


def strip_inert(
    data: dict[str, Any], prefix: str = "", inert: dict[str, str] | None = None
) -> list[str]:
    """Remove the inert keys (``inert``, default `INERT`: `rayrl train`'s) from the
    nested dict ``data`` in place; one warning each."""
    inert = INERT if inert is None else inert
    warnings: list[str] = []
    for key in list(data):
        path = f"{prefix}{key}"
        if path in inert:
            value = data.pop(key)
            shown = "{...}" if isinstance(value, dict) else repr(value)
            warnings.append(f"{path}={shown} has no effect in rayrl: {inert[path]}")
        elif isinstance(data[key], dict):
            warnings.extend(strip_inert(data[key], path + ".", inert))
    return warnings


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
