"""The check of ``actor_rollout_ref.actor.expert_parallel_size`` (and the reference's,
``actor_rollout_ref.ref.expert_parallel_size``) at load
(`check_expert_parallel`, called by `rayrl.config.validate`): the ranks that split a
mixture-of-experts model's experts (`rayrl.train.expert_parallel`) must divide the
actor's data-parallel world and the model's experts, and the model must have experts.
The engine checks the experts again when it builds the model (a model directory that
is not local yet is read there)."""

from __future__ import annotations

from rayrl.config.errors import ConfigError
from rayrl.config.layout import MeshError, MeshSpec, check_experts
from rayrl.config.schema import RayRLConfig
from rayrl.model_dirs import local_config

__all__ = ["check_expert_parallel", "model_experts"]


def model_experts(path: str | None) -> int | None | bool:
    """A local model directory's experts per block (``num_experts`` or Mixtral's
    ``num_local_experts``), None for a dense model, False when there is no config to
    read."""
    config = local_config(path)
    if config is None:
        return False
    for key in ("num_experts", "num_local_experts"):
        if config.get(key):
            return int(config[key])
    return None


def check_expert_parallel(cfg: RayRLConfig) -> None:
    """ConfigError, naming the key, unless the actor's expert-parallel size fits, and the
    reference's (``actor_rollout_ref.ref.expert_parallel_size``, the actor's unless set)
    where it has a model of its own (not with LoRA: adapters off are its reference)."""
    arr = cfg.actor_rollout_ref
    actor, ref = arr.actor, arr.ref
    _check_role(
        "actor",
        int(actor.expert_parallel_size),
        cfg,
        actor.ulysses_sequence_parallel_size,
        actor.fsdp_config.fsdp_size,
    )
    if not arr.model.lora_rank:
        _check_role(
            "ref",
            int(ref.expert_parallel_size),
            cfg,
            ref.ulysses_sequence_parallel_size,
            ref.fsdp_config.fsdp_size,
        )


def _check_role(role: str, ep: int, cfg: RayRLConfig, sp: int, fsdp_size: int) -> None:
    """One role's expert-parallel size against the world, its layout and the model."""
    if ep == 1:
        return
    key = f"actor_rollout_ref.{role}.expert_parallel_size"
    if cfg.actor_rollout_ref.model.lora_rank:
        raise ConfigError(
            f"{key}={ep} with "
            f"actor_rollout_ref.model.lora_rank={cfg.actor_rollout_ref.model.lora_rank}: LoRA "
            "adapters on experts split over ranks are not built yet (peft's expert adapters "
            "meet the ranks' expert shards in one matmul); set expert_parallel_size=1 for "
            "LoRA, or lora_rank=0 for expert parallelism"
        )
    try:
        MeshSpec(cfg.world_size, sp, fsdp_size, ep, ep_key=key)
        experts = model_experts(cfg.actor_rollout_ref.model.path)
        if experts is not False:
            check_experts(experts, ep, str(cfg.actor_rollout_ref.model.path), key)
    except MeshError as err:
        raise ConfigError(str(err)) from None
