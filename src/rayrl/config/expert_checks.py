"""The check of ``actor_rollout_ref.actor.expert_parallel_size`` at load
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
    """ConfigError, naming the key, unless the actor's expert-parallel size fits."""
    actor = cfg.actor_rollout_ref.actor
    ep = int(actor.expert_parallel_size)
    if ep == 1:
        return
    if cfg.actor_rollout_ref.model.lora_rank:
        raise ConfigError(
            f"actor_rollout_ref.actor.expert_parallel_size={ep} with "
            f"actor_rollout_ref.model.lora_rank={cfg.actor_rollout_ref.model.lora_rank}: LoRA "
            "adapters on experts split over ranks are not built yet (peft's expert adapters "
            "meet the ranks' expert shards in one matmul); set expert_parallel_size=1 for "
            "LoRA, or lora_rank=0 for expert parallelism"
        )
    try:
        MeshSpec(
            cfg.world_size, actor.ulysses_sequence_parallel_size, actor.fsdp_config.fsdp_size, ep
        )
        experts = model_experts(cfg.actor_rollout_ref.model.path)
        if experts is not False:
            check_experts(experts, ep, str(cfg.actor_rollout_ref.model.path))
    except MeshError as err:
        raise ConfigError(str(err)) from None
