"""The config checks of a vision-language policy (issue 48), before anything starts.

rayrl rolls out a vision-language model with the hf engine or the native one (its own
vision tower, the image features in the prefill, M-RoPE positions:
`rayrl.rollout.native.vision`), single turns or, on the hf engine, multi-turn episodes
whose tools and environments may show it more images (`rayrl.rollout.agent.rollout`),
synchronously or on asynchronous replicas (``rollout.mode=async``: the prompts' images
travel to the replicas and back), and trains it with GRPO-style critic-free estimators
(every image of a sample spliced into the actor's and reference's forwards:
`rayrl.train.vision_inputs`). What is not built yet is refused here, naming what to
change: a tensor-parallel native rollout, multi-turn episodes on the native engine, a
critic, Ulysses sequence parallelism and the Ray Data loader. LoRA puts adapters on the vision tower's linear layers too (peft's
``all-linear``), unless ``actor.freeze_vision_tower`` or ``model.exclude_modules``
keeps them out of training. ``actor.freeze_vision_tower`` on a text-only model is refused too.
Which families are run (Qwen2-VL, Qwen2.5-VL) is checked where the model's processor is
loaded (`rayrl.trainer.data`). A local model directory is judged by its config.json.
"""

from __future__ import annotations

from rayrl.config.errors import ConfigError
from rayrl.config.schema import RayRLConfig
from rayrl.model_dirs import is_vision_language, local_config

__all__ = ["check_vision_language"]

ARR = "actor_rollout_ref"


def check_vision_language(cfg: RayRLConfig, critic: bool) -> None:
    """ConfigError for the first setting a vision-language actor cannot run with (module
    docstring); ``critic``: whether the run trains a critic."""
    arr = cfg.actor_rollout_ref
    vision = _is_vision_language(arr.model.path)
    if arr.actor.freeze_vision_tower and vision is False:
        raise ConfigError(
            f"{ARR}.actor.freeze_vision_tower=true, but {ARR}.model.path={arr.model.path} is a "
            "text-only model (its config.json has no vision_config); set it to false"
        )
    if _is_vision_language(cfg.critic.model.path):
        raise ConfigError(
            f"critic.model.path={cfg.critic.model.path} is a vision-language model: rayrl "
            "has no value model with a vision tower yet; give a text-only critic, or train "
            "without a critic (algorithm.adv_estimator=grpo)"
        )
    if not vision:
        return
    where = f"{ARR}.model.path={arr.model.path} is a vision-language model, and"
    for refused, what, change in _unbuilt(cfg, critic):
        if refused:
            raise ConfigError(f"{where} {what} is not built yet (issue 48); {change}")


def _unbuilt(cfg: RayRLConfig, critic: bool) -> list[tuple[bool, str, str]]:
    """(refused, what is not built for a vision-language model, what to change)."""
    arr = cfg.actor_rollout_ref
    rollout = arr.rollout
    sp = max(arr.actor.ulysses_sequence_parallel_size, arr.ref.ulysses_sequence_parallel_size)
    return [
        (
            rollout.name == "native" and rollout.tensor_model_parallel_size > 1,
            "a tensor-parallel rollout on the native engine (its vision tower is not split)",
            f"set {ARR}.rollout.tensor_model_parallel_size=1, or {ARR}.rollout.name=hf",
        ),
        (
            rollout.name == "native" and rollout.multi_turn.enable,
            "multi-turn episodes on the native engine (it feeds a prompt's images at its "
            "prefill only, not a tool's or an environment's)",
            f"set {ARR}.rollout.name=hf for multi-turn episodes with images",
        ),
        (
            critic,
            "a critic (a value model with a vision tower)",
            "use a critic-free estimator (algorithm.adv_estimator=grpo, rloo, ...) and "
            "critic.enable=false",
        ),
        (
            sp > 1,
            "Ulysses sequence parallelism (its images would be split between ranks)",
            f"set {ARR}.actor.ulysses_sequence_parallel_size=1 and "
            f"{ARR}.ref.ulysses_sequence_parallel_size=1",
        ),
        (
            cfg.data.loader == "ray",
            "the Ray Data loader (its tasks have no image processor)",
            "set data.loader=default",
        ),
    ]


def _is_vision_language(path: str | None) -> bool | None:
    """Whether the local model directory ``path`` is a vision-language model's; None when
    it has no readable config.json (a hub name: the engine judges it when it loads)."""
    if not path:
        return None
    config = local_config(path)
    return None if config is None else is_vision_language(config)
