"""The check of ``actor_rollout_ref.actor.expert_parallel_size`` at load
(`check_expert_parallel`, called by `rayrl.config.validate`): the ranks that split a
mixture-of-experts model's experts (`rayrl.train.expert_parallel`) must divide the
actor's data-parallel world and the model's experts, and the model must have experts.
The engine checks the experts again when it builds the model (a model directory that
is not local yet is read there)."""

from __future__ import annotations

import json
from pathlib import Path

from rayrl.config.errors import ConfigError
from rayrl.config.layout import MeshError, MeshSpec, check_experts
from rayrl.config.schema import RayRLConfig

__all__ = ["check_expert_parallel", "model_experts"]


def model_experts(path: str | None) -> int | None | bool:
    """A local model directory's experts per block (``num_experts`` or Mixtral's
    ``num_local_experts``), None for a dense model, False when there is no config to
    read."""
    file = Path(path) / "config.json" if path else None
    if file is None or not file.is_file():
        return False
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError):
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
    try:
        MeshSpec(
            cfg.world_size, actor.ulysses_sequence_parallel_size, actor.fsdp_config.fsdp_size, ep
        )
        experts = model_experts(cfg.actor_rollout_ref.model.path)
        if experts is not False:
            check_experts(experts, ep, str(cfg.actor_rollout_ref.model.path))
    except MeshError as err:
        raise ConfigError(str(err)) from None
