"""The checks of routing replay's keys at load (`check_router_replay`, called by
`rayrl.config.validate`): ``actor_rollout_ref.actor.router_replay.mode`` and
``actor_rollout_ref.rollout.enable_rollout_routing_replay`` (verl's names) against the
rest of the config.

What cannot work is refused, with the setting that makes it work: R3 without the
rollout's record, R2 without the log-prob pass it records in (bypass mode), a record
from an engine that cannot make one (hf), sequence parallelism. What has no effect is said in a warning and left alone, as for other keys
of that kind: a dense model (nothing to record or replay), and the actor's regional
``torch.compile``, which the routers' hooks turn off.
"""

from __future__ import annotations

from collections.abc import Callable

from rayrl.config.errors import ConfigError
from rayrl.config.schema import RayRLConfig
from rayrl.model_dirs import local_config

__all__ = ["MOE_MODEL_TYPES", "ROUTER_REPLAY_MODES", "check_router_replay", "routing_on"]

ROUTER_REPLAY_MODES = ("disabled", "R2", "R3")
# The model families whose routing the native engine records and training replays
# (`rayrl.train.router_replay.ROUTER_STYLES`)
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
MODE = "actor_rollout_ref.actor.router_replay.mode"
RECORD = "actor_rollout_ref.rollout.enable_rollout_routing_replay"


def routing_on(cfg: RayRLConfig) -> bool:
    """Whether the actor's passes touch the routing: a replay mode, or the rollout's
    record to compare with."""
    arr = cfg.actor_rollout_ref
    return arr.actor.router_replay.mode != "disabled" or arr.rollout.enable_rollout_routing_replay


def check_router_replay(cfg: RayRLConfig, warn: Callable[[str], None]) -> None:
    """Routing replay's keys (module docstring); nothing when both are off."""
    if not routing_on(cfg):
        return
    arr = cfg.actor_rollout_ref
    mode, record = arr.actor.router_replay.mode, arr.rollout.enable_rollout_routing_replay
    if mode == "R3" and not record:
        raise ConfigError(
            f"{MODE}=R3 replays the rollout's record of each token's experts, which the "
            f"rollout makes only with {RECORD}=true: set it (rollout.name=native), or use "
            "R2 (the actor's log-prob pass records the routing the update replays)"
        )
    if mode == "R2" and cfg.algorithm.rollout_correction.bypass_mode:
        raise ConfigError(
            f"{MODE}=R2 records the routing in the actor's log-prob pass, which "
            "algorithm.rollout_correction.bypass_mode=true skips (the rollout's log-probs "
            f"serve): use R3 with {RECORD}=true (the rollout's record), or turn bypass_mode off"
        )
    if record:
        _check_recording_engine(cfg)
    if arr.actor.ulysses_sequence_parallel_size > 1:
        raise ConfigError(
            f"{MODE}={mode} with {RECORD}={record} does not run with Ulysses sequence "
            "parallelism yet (actor_rollout_ref.actor.ulysses_sequence_parallel_size="
            f"{arr.actor.ulysses_sequence_parallel_size}); set it to 1, or turn both off"
        )
    model_type = _model_type(arr.model.path)
    if model_type is not None and model_type not in MOE_MODEL_TYPES:
        warn(
            f"{MODE}={mode} and {RECORD}={record} have no effect: the model "
            f"({arr.model.path or 'the built-in demo model'}) is a {model_type}, not a "
            f"mixture of experts ({', '.join(MOE_MODEL_TYPES)}): nothing to record or replay"
        )
    elif arr.actor.use_torch_compile and cfg.trainer.device != "cpu":
        warn(
            f"actor_rollout_ref.actor.use_torch_compile=true has no effect with {MODE}={mode} "
            f"and {RECORD}={record}: the actor's decoder layers run eager, as the hooks on "
            "their routers do (the reference's compile is kept)"
        )


def _check_recording_engine(cfg: RayRLConfig) -> None:
    """The rollout engine can record each token's experts: native, not hf (``auto``
    picks hf on a CPU; on a GPU the worker checks the engine ``auto`` resolves to)."""
    name, device = cfg.actor_rollout_ref.rollout.name, cfg.trainer.device
    if name == "hf" or (name == "auto" and device == "cpu"):
        picked = "" if name == "hf" else " (rollout.name=auto picks it on a CPU)"
        raise ConfigError(
            f"{RECORD}=true needs a rollout engine that records each token's experts; the "
            f"hf engine{picked} does not: set actor_rollout_ref.rollout.name=native"
        )


def _model_type(path: str | None) -> str | None:
    """The model's ``model_type`` from a local directory's config.json (the built-in demo
    model, a Qwen2, when there is no path); None when it cannot be read here."""
    if not path:
        return "qwen2"
    config = local_config(path)
    model_type = config.get("model_type") if config is not None else None
    return str(model_type) if model_type else None
